#include "parallelisms/fully_shard.h"

#include <algorithm>

#include "parallelisms/comm/delay.h"
#include "parallelisms/comm/flight_recorder.h"
#include "parallelisms/comm/trace_span.h"
#include "parallelisms/config_fields.h"
#include "parallelisms/fully_shard_units.h"
#include "parallelisms/per_rank.h"

namespace composer::parallel {

// Where one all-gather input of a parameter sits in its unit's per-rank byte buffer.
struct Slot {
  int64_t offset = 0;
  int64_t bytes = 0;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;
};

struct FullyShard::Param {
  torch::Tensor param;                   // registered; its data is this rank's shard
  std::vector<int64_t> shape;            // the parameter's own shape (may be 0-dim)
  ShardInfo info;
  c10::ScalarType compute_dtype = c10::kFloat;
  const AllGatherExtension* ext = nullptr;
  std::vector<Slot> slots;               // its all-gather inputs
  int64_t grad_offset = 0;               // in the unit's per-rank gradient chunk
  int64_t unsharded_offset = 0;          // bytes, in the unit's unsharded buffer
  std::vector<nn::Module*> users;        // modules that compute with it
  torch::Tensor full;                    // the unsharded tensor while gathered
};

struct FullyShard::Unit {
  std::string name;
  nn::Module* module = nullptr;
  bool root = false;                     // the model or a pipeline stage: gathered until reshard()
  FullyShard* owner = nullptr;
  std::vector<Param> params;
  Group* group = nullptr;
  bool reshard_after_forward = true;
  const bool* sync = nullptr;            // the owner's requires-sync flag
  c10::ScalarType reduce_dtype = c10::kFloat;
  std::optional<c10::ScalarType> input_dtype;  // the root casts float inputs to param_dtype
  int64_t gather_bytes = 0;              // per rank
  int64_t grad_numel = 0;                // per rank, in reduce_dtype
  int64_t unsharded_bytes = 0;           // every unsharded parameter, in compute dtypes
  int64_t needs[FullyShard::kNumBufferKinds] = {};  // the bytes of each pooled buffer it takes
  // A one-rank group whose parameters' extensions write alone: gathering is a
  // cast of each shard into the unsharded buffer, reducing a cast of each
  // gradient to the shard's dtype; no send, receive or gradient buffers.
  bool alone = false;
  torch::Tensor unsharded_base;          // a pooled buffer the unsharded parameters live in
  bool freed = false;                    // storage released after forward
  torch::Tensor pending;                 // unreduced gradients of earlier microbatches
  std::vector<char> has_grad;            // per parameter: a gradient arrived since the last reduction
  // Resharded to a smaller group: this rank's rows of the last full gather
  // ([shard group size / N, gather_bytes]), re-gathered over that group.
  torch::Tensor kept;
  // An all-gather in flight (or finished but not yet copied out).
  Handle gather;
  torch::Tensor send_base, recv_base, recv;
  std::unique_ptr<TraceSpan> forward_span;  // "forward <unit>" in a profiled step, pre- to post-hook
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kAlign = 16;
int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}
int64_t bytes_of(const std::vector<int64_t>& shape, c10::ScalarType t) { return numel_of(shape) * c10::elementSize(t); }

void no_delete(void*) {}

// Points a tensor's storage at `bytes` bytes at `ptr` (owned by the pool), or
// at nothing. A meta tensor (a dry run) has no data: only its size changes.
void bind_storage(const torch::Tensor& t, uint8_t* ptr, int64_t bytes) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(ptr, ptr, &no_delete, t.device()));
  s->set_nbytes(static_cast<size_t>(bytes));
}

// A tensor over `ptr` owned by the pool (from_blob); on meta, a tensor whose
// storage takes no bytes of its own, as from_blob's does not.
torch::Tensor pool_view(uint8_t* ptr, const std::vector<int64_t>& shape, c10::ScalarType dtype, c10::Device device) {
  if (!device.is_meta()) return torch::from_blob(ptr, shape, torch::TensorOptions().dtype(dtype).device(device));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes_of(shape, dtype), at::DataPtr(nullptr, device),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                    caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

int64_t unsharded_bytes_of(const FullyShard::Param& p) { return bytes_of(p.info.full_shape, p.compute_dtype); }

// Issues the unit's all-gather (async): every parameter's inputs packed into
// one byte buffer, one collective.
void start_gather(FullyShard::Unit& u) {
  TORCH_INTERNAL_ASSERT(!u.recv.defined(), "unit ", u.name, " is already being gathered");
  if (u.alone) return;  // finish_gather casts each shard in place
  torch::NoGradGuard no_grad;
  Group& g = *u.group;
  CommSite site("fully_shard " + u.name);  // the flight recorder's code site
  if (u.kept.defined()) {  // resharded to a smaller group: gather the kept rows over it
    Group& sub = *u.owner->post_forward_group();
    u.recv_base = u.owner->take_buffer(FullyShard::kRecv, u.needs[FullyShard::kRecv]);
    auto all = u.recv_base.narrow(0, 0, g.size * u.gather_bytes);
    u.recv = all.view({g.size, u.gather_bytes});
    if (FullyShard::Unit* other = u.owner->in_flight) other->gather.wait();
    u.gather = all_gather_into(sub, u.kept.view({-1}), all.view({sub.size, -1}), /*async=*/true);
    u.owner->in_flight = &u;
    return;
  }
  u.send_base = u.owner->take_buffer(FullyShard::kSend, u.needs[FullyShard::kSend]);
  auto send = u.send_base.narrow(0, 0, u.gather_bytes);
  for (auto& p : u.params) {
    auto inputs = p.ext->pre_all_gather(p.param.detach(), p.info, p.compute_dtype);
    TORCH_CHECK(inputs.size() == p.slots.size(), "all-gather extension ", p.ext->name(), " returned ",
                inputs.size(), " tensors, not ", p.slots.size(), " as at setup");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Slot& s = p.slots[i];
      TORCH_CHECK(inputs[i].sizes().vec() == s.shape && inputs[i].scalar_type() == s.dtype, "all-gather extension ",
                  p.ext->name(), " changed an input's shape or dtype since setup");
      send.narrow(0, s.offset, s.bytes).view(s.dtype).view(s.shape).copy_(inputs[i]);
    }
  }
  if (g.size == 1) {
    u.recv = send.view({1, u.gather_bytes});
    return;
  }
  u.recv_base = u.owner->take_buffer(FullyShard::kRecv, u.needs[FullyShard::kRecv]);
  u.recv = u.recv_base.narrow(0, 0, g.size * u.gather_bytes).view({g.size, u.gather_bytes});
  // One ring in flight per group: finish another unit's prefetch first.
  if (FullyShard::Unit* other = u.owner->in_flight) other->gather.wait();
  u.gather = all_gather_into(g, send, u.recv, /*async=*/true);
  u.owner->in_flight = &u;
}

// Waits for the unit's all-gather and turns it into unsharded values: new
// tensors, or (refill) written into the existing unsharded storage.
std::vector<torch::Tensor> finish_gather(FullyShard::Unit& u, bool refill) {
  torch::NoGradGuard no_grad;
  if (!u.recv.defined()) start_gather(u);
  delay_at(u.group->delays, DelayPoint::kBeforeAllGatherWait);
  u.gather.wait();
  if (u.owner->in_flight == &u) u.owner->in_flight = nullptr;
  std::vector<torch::Tensor> values;
  TORCH_INTERNAL_ASSERT(!u.unsharded_base.defined(), "unit ", u.name, " is gathered twice");
  u.unsharded_base = u.owner->take_buffer(FullyShard::kUnsharded, u.needs[FullyShard::kUnsharded]);
  for (auto& p : u.params) {
    std::vector<torch::Tensor> gathered;
    for (const Slot& s : p.slots) {
      if (u.alone) break;
      std::vector<int64_t> shape{u.group->size};
      shape.insert(shape.end(), s.shape.begin(), s.shape.end());
      gathered.push_back(u.recv.narrow(1, s.offset, s.bytes).view(s.dtype).view(shape));
    }
    // The unsharded values live in one pooled buffer per unit: a re-gather
    // (refill) binds the existing tensors, whose autograd-saved handles stay
    // valid, to it again.
    const bool meta = u.unsharded_base.is_meta();
    uint8_t* at = meta ? nullptr : u.unsharded_base.data_ptr<uint8_t>() + p.unsharded_offset;
    torch::Tensor out;
    if (refill) {
      bind_storage(p.full, at, unsharded_bytes_of(p));
      out = p.full.variable_data().view(p.info.full_shape);  // .data semantics: no version bump
    } else {
      out = pool_view(at, p.info.full_shape, p.compute_dtype, u.unsharded_base.device());
    }
    if (u.alone) {
      p.ext->write_alone(p.param.detach(), p.info, p.compute_dtype, out);
    } else {
      p.ext->post_all_gather(gathered, p.info, p.compute_dtype, out);
    }
    if (!refill) values.push_back(out.view(p.shape));
  }
  // Resharding to a smaller group of N keeps this rank's share of a full gather: for its position j in that
  // group, the rows of the shard group's ranks j * W / N ... (j + 1) * W / N - 1, which its re-gather lays back.
  Group* sub = u.owner->post_forward_group();
  if (sub && u.reshard_after_forward && !u.kept.defined()) {
    const int64_t rows = u.group->size / sub->size;
    u.kept = u.recv.narrow(0, sub->rank * rows, rows).clone();
  }
  if (u.send_base.defined()) u.owner->give_buffer(FullyShard::kSend, std::move(u.send_base));
  if (u.recv_base.defined()) u.owner->give_buffer(FullyShard::kRecv, std::move(u.recv_base));
  u.send_base = u.recv_base = u.recv = torch::Tensor();
  return values;
}

// One reduce-scatter (average) of the unit's gradients, including those held back from earlier microbatches,
// into shard gradients. Without sync the gradients are only held back, so accumulation reduce-scatters once.
// The reductions over other dims (HSDP's replicate dim, tp sums, tied pipeline weights) are the gradient
// synchronisation's, read from the placements. A parameter that got no gradient keeps none.
// One rank: its gradient is the average, rounded to the reduce dtype as the
// buffer would hold it, then to the shard's dtype and device.
std::vector<torch::Tensor> average_alone(const FullyShard::Unit& u, const variable_list& grads) {
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < u.params.size(); ++i) {
    const auto& p = u.params[i];
    if (!grads[i].defined()) {
      out.emplace_back();
      continue;
    }
    auto grad = grads[i].reshape(p.info.full_shape).to(u.reduce_dtype);
    out.push_back(grad.to(p.param.device(), p.param.scalar_type()).view(p.info.shard_shape(0)));
  }
  return out;
}

std::vector<torch::Tensor> reduce_unit(FullyShard::Unit& u, const variable_list& grads) {
  Group& g = *u.group;
  const bool sync = *u.sync;
  torch::Tensor base, buf;
  const bool accumulate = u.pending.defined();
  if (u.alone && sync && !accumulate) return average_alone(u, grads);
  if (accumulate) {
    buf = u.pending;
  } else if (!sync) {
    buf = torch::zeros({g.size, u.grad_numel}, torch::TensorOptions().dtype(u.reduce_dtype).device(u.owner->device()));
  } else {
    const int64_t bytes = g.size * u.grad_numel * static_cast<int64_t>(c10::elementSize(u.reduce_dtype));
    base = u.owner->take_buffer(FullyShard::kGrad, u.needs[FullyShard::kGrad]);
    buf = base.narrow(0, 0, bytes).view(u.reduce_dtype).view({g.size, u.grad_numel}).zero_();
  }
  u.has_grad.resize(u.params.size(), 0);
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    if (!grads[i].defined()) continue;
    u.has_grad[i] = 1;
    auto full = grads[i].reshape(p.info.full_shape);
    for (int r = 0; r < g.size; ++r) {
      if (!p.info.sizes[r]) continue;
      auto piece = full.narrow(p.info.dim, p.info.offset(r), p.info.sizes[r]);
      auto dst = buf[r].narrow(0, p.grad_offset, numel_of(p.info.shard_shape(r))).view(p.info.shard_shape(r));
      if (accumulate) dst.add_(piece.to(u.reduce_dtype));
      else dst.copy_(piece);
    }
  }
  if (!sync) {
    u.pending = buf;
    return std::vector<torch::Tensor>(u.params.size());
  }
  u.pending = torch::Tensor();
  CommSite site("fully_shard " + u.name);
  auto mine = reduce_scatter_flat(g, buf.view({-1}), Reduce::kAvg);
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    auto shape = p.info.shard_shape(g.rank);
    if (!u.has_grad[i]) {
      out.emplace_back();
      continue;
    }
    // The shard's gradient lives where the shard does (host memory when offloaded) in the shard's
    // dtype: a view of the reduce-scatter's output where they are already its (no copy, as FSDP2's
    // sharded gradients are views of its reduce output), else a copy.
    auto grad = mine.narrow(0, p.grad_offset, numel_of(shape)).view(shape);
    const bool in_place = grad.device() == p.param.device() && grad.scalar_type() == p.param.scalar_type();
    out.push_back(in_place ? grad : grad.to(p.param.device(), p.param.scalar_type(), /*non_blocking=*/false,
                                            /*copy=*/true));
  }
  std::fill(u.has_grad.begin(), u.has_grad.end(), 0);
  if (base.defined()) u.owner->give_buffer(FullyShard::kGrad, std::move(base));
  return out;
}

// Forward: the unit's shards -> unsharded parameters (one all-gather, maybe
// issued earlier by a prefetch). Backward: their gradients -> shard gradients
// (one reduce-scatter).
struct UnshardFn : torch::autograd::Function<UnshardFn> {
  static variable_list forward(AutogradContext* ctx, at::TensorList shards, int64_t unit) {
    ctx->saved_data["unit"] = unit;
    ctx->set_materialize_grads(false);  // an unused parameter's gradient stays undefined
    auto values = finish_gather(*reinterpret_cast<FullyShard::Unit*>(unit), /*refill=*/false);
    // A frozen parameter's unsharded value needs no gradient: autograd computes none for it.
    variable_list frozen;
    for (size_t i = 0; i < shards.size(); ++i) {
      if (!shards[i].requires_grad()) frozen.push_back(values[i]);
    }
    if (!frozen.empty()) ctx->mark_non_differentiable(frozen);
    return values;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& u = *reinterpret_cast<FullyShard::Unit*>(ctx->saved_data["unit"].toInt());
    auto out = reduce_unit(u, grads);
    out.push_back(torch::Tensor());
    return out;
  }
};

// Unbinds the unsharded tensors from their buffer and returns it to the pool.
void release_unsharded(FullyShard::Unit& u) {
  if (!u.unsharded_base.defined()) return;
  delay_at(u.group->delays, DelayPoint::kBeforeFree);
  for (auto& p : u.params) {
    if (p.full.defined()) bind_storage(p.full, nullptr, 0);
  }
  u.owner->give_buffer(FullyShard::kUnsharded, std::move(u.unsharded_base));
  u.unsharded_base = torch::Tensor();
}

void set_views(FullyShard::Unit& u) {
  for (auto& p : u.params) {
    for (auto* m : p.users) m->set_view(p.param, p.full);
  }
}

void refill_storage(FullyShard::Unit& u) {
  if (!u.freed) return;
  finish_gather(u, /*refill=*/true);
  u.freed = false;
}

void unshard(FullyShard::Unit& u) {
  if (u.unsharded_base.defined() || u.freed) {  // a second forward of the unit in this step
    refill_storage(u);
    set_views(u);
    return;
  }
  std::vector<torch::Tensor> shards;
  for (auto& p : u.params) shards.push_back(p.param);
  auto fulls = UnshardFn::apply(at::TensorList(shards), reinterpret_cast<int64_t>(&u));
  for (size_t i = 0; i < u.params.size(); ++i) u.params[i].full = fulls[i];
  set_views(u);
}

// Whether a prefetch of `u` would bring anything: not while its gather is in
// flight or its unsharded storage is bound (units kept gathered over a
// pipeline's microbatches).
bool needs_gather(const FullyShard::Unit& u) {
  return !u.recv.defined() && (!u.unsharded_base.defined() || u.freed) && !u.params.empty();
}

// Frees the unsharded storage; autograd keeps its handles, refilled before backward.
void reshard_storage(FullyShard::Unit& u) {
  release_unsharded(u);
  u.freed = true;
}

// fully_shard's dims in a parameter's spec: Replicate over HSDP's replicate dim and Shard over the
// shard dim; gradients are averaged over both. A dim an earlier transform replicated the parameter
// over (expert_parallel's, borrowed, alone or as one of the dims flattened into the shard dim) is
// fully_shard's now.
void record_placement(ShardSpec& spec, Group& shard, Group* replicate, int64_t dim) {
  auto& dims = spec.dims;
  const std::vector<std::string> spanned = flat_dims({shard.name});
  auto replica_here = [&](const SpecDim& d) {
    return !d.param.is_shard() && std::find(spanned.begin(), spanned.end(), d.name) != spanned.end();
  };
  dims.erase(std::remove_if(dims.begin(), dims.end(), replica_here), dims.end());
  if (replicate) {
    spec.dims.push_back({replicate->name, replicate, replicate->size, replicate->rank, Placement::replicate(),
                         Placement::partial(Reduce::kAvg)});
  }
  spec.dims.push_back({shard.name, &shard, shard.size, shard.rank, Placement::shard(dim),
                       Placement::partial(Reduce::kAvg)});
}

}  // namespace

std::optional<std::string> check_units(models::Model& model, const std::vector<std::string>& units) {
  auto modules = nn::named_modules(model);
  for (const auto& pattern : units) {
    bool found = false;
    for (auto& [name, m] : modules) found = found || (!name.empty() && models::fqn_matches(pattern, name));
    if (!found) return pattern + ": unit pattern matches no module of " + model.type();
  }
  return std::nullopt;
}

FullyShard::FullyShard(models::Model& model, Group& group, const FullyShardOptions& options)
    : FullyShard(std::vector<models::Root>{models::whole(model)}, group, options) {}

FullyShard::FullyShard(const std::vector<models::Root>& roots, Group& group, const FullyShardOptions& options)
    : group_(group), options_(options) {
  // Units: every matching module of every root, then the roots themselves.
  const Ownership own = assign_owners(roots, options.units);
  for (auto& [name, m] : own.units) add_unit(name, m, /*root=*/false);
  for (const auto& root : roots) add_unit(root.name, root.module, /*root=*/true);
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : models::root_parameters(roots)) {
    if (per_rank_selects(options.per_rank, name)) continue;  // each rank's own: neither sharded nor reduced
    if (options.already_split && options.already_split(p)) {
      if (options.replicate && options.placements) {
        options.placements->add(p, {options.replicate->name, options.replicate, options.replicate->size,
                                    options.replicate->rank, Placement::replicate(), Placement::partial(Reduce::kAvg)});
      }
      continue;
    }
    auto it = own.owner.find(p.unsafeGetTensorImpl());
    TORCH_INTERNAL_ASSERT(it != own.owner.end(), "parameter ", name, " has no module that computes with it");
    shard_param(*units_[it->second], name, p, own.users.at(p.unsafeGetTensorImpl()));
  }
  size_pools();
  if (options.param_dtype) {  // inputs in, outputs out of the compute dtype at every root
    for (const auto& root : roots) cast_at(*root.module);
  }
  for (auto& u : units_) {
    if (!u->params.empty()) install_hooks(u.get());
  }
}

void FullyShard::add_unit(const std::string& name, nn::Module* m, bool root) {
  auto unit = std::make_unique<Unit>();
  unit->name = name;
  unit->module = m;
  unit->owner = this;
  unit->group = &group_;
  unit->root = root;
  unit->reshard_after_forward = options_.reshard_after_forward && !root;  // a root stays gathered
  unit->sync = &sync_;
  units_.push_back(std::move(unit));
}

void FullyShard::shard_param(Unit& u, const std::string& name, const torch::Tensor& p,
                             const std::vector<nn::Module*>& users) {
  Param q;
  q.param = p;
  device_ = nn::param_options().device();  // meta in a dry run; a model being materialised is on meta now, not later
  q.shape = p.sizes().vec();
  auto full_shape = q.shape.empty() ? std::vector<int64_t>{1} : q.shape;
  int64_t dim = options_.shard_dim ? options_.shard_dim(p) : 0;
  if (dim < 0) dim += static_cast<int64_t>(full_shape.size());
  TORCH_CHECK(dim >= 0 && dim < static_cast<int64_t>(full_shape.size()), "shard dim ", dim, " is out of range for ",
              name, " of shape ", p.sizes());
  q.info.full_shape = full_shape;
  q.info.dim = dim;
  q.info.sizes = chunk_sizes(full_shape[dim], group_.size);
  q.info.rank = group_.rank;
  q.info.world = group_.size;
  q.compute_dtype = options_.param_dtype.value_or(p.scalar_type());
  q.ext = options_.extension && p.scalar_type() == torch::kFloat ? options_.extension.get() : &default_all_gather();
  q.users = users;
  if (options_.placements) record_placement(options_.placements->of(p), group_, options_.replicate, dim);
  auto local = p.detach().reshape(full_shape).narrow(dim, q.info.offset(group_.rank), q.info.sizes[group_.rank]);
  torch::Tensor shard = local.contiguous().clone();
  // Offloaded: the shard (so its gradient and optimizer state) in pinned host
  // memory; a model still on meta gets its values there later (materialise).
  if (options_.offload && !shard.is_meta()) shard = shard.to(torch::kCPU).pin_memory();
  p.set_data(shard);
  if (p.requires_grad()) {  // a frozen parameter (train.freeze) is gathered, never reduce-scattered
    q.grad_offset = u.grad_numel;
    u.grad_numel += numel_of(q.info.padded_shape());
  }
  for (const auto& in : q.ext->pre_all_gather(p.detach(), q.info, q.compute_dtype)) {
    Slot s{u.gather_bytes, bytes_of(in.sizes().vec(), in.scalar_type()), in.scalar_type(), in.sizes().vec()};
    u.gather_bytes += aligned(s.bytes);
    q.slots.push_back(s);
  }
  q.unsharded_offset = u.unsharded_bytes;
  u.unsharded_bytes += aligned(unsharded_bytes_of(q));
  u.params.push_back(q);
}

void FullyShard::size_pools() {
  for (auto& u : units_) {
    if (u->params.empty()) continue;
    u->reduce_dtype = options_.reduce_dtype.value_or(u->params.front().compute_dtype);
    u->alone = group_.size == 1 &&
               std::all_of(u->params.begin(), u->params.end(), [](const Param& q) { return q.ext->writes_alone(); });
    const int64_t grad_bytes = group_.size * u->grad_numel * static_cast<int64_t>(c10::elementSize(u->reduce_dtype));
    for (auto [kind, bytes] : {std::pair{kSend, u->gather_bytes}, std::pair{kRecv, group_.size * u->gather_bytes},
                               std::pair{kGrad, grad_bytes}, std::pair{kUnsharded, u->unsharded_bytes}}) {
      u->needs[kind] = u->alone && kind != kUnsharded ? 0 : bytes;
    }
    for (auto& q : u->params) by_impl_[q.param.unsafeGetTensorImpl()] = &q;
  }
}

void FullyShard::cast_at(nn::Module& root) {
  const auto compute = *options_.param_dtype;
  c10::ScalarType train = torch::kFloat;
  for (auto& u : units_) {
    if (!u->params.empty()) train = u->params.front().param.scalar_type();
  }
  root.add_pre_hook([compute](nn::Module&, torch::Tensor x) { return x.is_floating_point() ? x.to(compute) : x; });
  root.add_post_hook([train](nn::Module&, const torch::Tensor&, torch::Tensor y) {
    return y.is_floating_point() ? y.to(train) : y;
  });
}

void FullyShard::install_hooks(Unit* u) {
  u->module->add_pre_hook([this, u](nn::Module&, torch::Tensor x) {
    u->forward_span.reset();
    u->forward_span = std::make_unique<TraceSpan>([u] { return "forward " + u->name; });
    if (recording_) record_forward(u);
    unshard(*u);  // every forward gathers the current shards (or finishes a prefetched gather)
    Unit* next = options_.prefetch && !recording_ ? next_in_forward(u) : nullptr;
    if (next && needs_gather(*next)) start_gather(*next);
    return x;
  });
  u->module->add_post_hook([this, u](nn::Module&, const torch::Tensor&, torch::Tensor y) {
    u->forward_span.reset();
    if (!u->reshard_after_forward || (!y.requires_grad() && !forward_only_)) return y;
    reshard_storage(*u);
    if (forward_only_) return y;
    y.register_hook([this, u](torch::Tensor g) {
      refill_storage(*u);  // runs before this unit's backward
      Unit* prev = options_.prefetch ? prev_in_forward(u) : nullptr;  // the next unit in backward
      if (prev && prev->freed && needs_gather(*prev)) start_gather(*prev);
      return g;
    });
    return y;
  });
}

FullyShard::~FullyShard() = default;

size_t FullyShard::num_units() const {
  size_t n = 0;
  for (const auto& u : units_) n += u->params.empty() ? 0 : 1;
  return n;
}

void FullyShard::record_forward(Unit* u) {
  if (std::find(forward_order_.begin(), forward_order_.end(), u) == forward_order_.end()) forward_order_.push_back(u);
}

FullyShard::Unit* FullyShard::next_in_forward(const Unit* u) const {
  auto it = std::find(forward_order_.begin(), forward_order_.end(), u);
  return it == forward_order_.end() || it + 1 == forward_order_.end() ? nullptr : *(it + 1);
}

FullyShard::Unit* FullyShard::prev_in_forward(const Unit* u) const {
  auto it = std::find(forward_order_.begin(), forward_order_.end(), u);
  return it == forward_order_.end() || it == forward_order_.begin() ? nullptr : *(it - 1);
}

// A caching allocator per kind: the smallest free buffer that holds `bytes`,
// else a new one of exactly that size. Units of one size (the blocks) share
// their buffers; a larger unit (a root with the embeddings) does not make
// every buffer its size, which would multiply what the units hold at once
// (each block's re-gathered parameters until the step ends).
torch::Tensor FullyShard::take_buffer(BufferKind kind, int64_t bytes) {
  bytes = std::max<int64_t>(bytes, 1);
  auto& free = pool_[kind];
  auto best = free.end();
  for (auto it = free.begin(); it != free.end(); ++it) {
    if (it->numel() >= bytes && (best == free.end() || it->numel() < best->numel())) best = it;
  }
  if (best == free.end()) {
    pooled_bytes_ += bytes;
    return torch::empty({bytes}, torch::TensorOptions().dtype(torch::kByte).device(device_));
  }
  auto t = std::move(*best);
  free.erase(best);
  return t;
}

void FullyShard::give_buffer(BufferKind kind, torch::Tensor t) { pool_[kind].push_back(std::move(t)); }

void FullyShard::reshard() {
  for (auto& u : units_) {
    if (u->recv.defined()) {  // a prefetch nobody used
      u->gather.wait();
      in_flight = nullptr;
      if (u->send_base.defined()) give_buffer(kSend, std::move(u->send_base));
      if (u->recv_base.defined()) give_buffer(kRecv, std::move(u->recv_base));
      u->send_base = u->recv_base = u->recv = torch::Tensor();
    }
    release_unsharded(*u);
    u->kept = torch::Tensor();
    for (auto& p : u->params) {
      for (auto* m : p.users) m->clear_view(p.param);
      p.full = torch::Tensor();
    }
    u->freed = false;
  }
  recording_ = false;
}

void FullyShard::flush() {
  const bool sync = sync_;
  sync_ = true;
  torch::NoGradGuard no_grad;
  for (auto& u : units_) {
    if (!u->pending.defined()) continue;
    auto grads = reduce_unit(*u, torch::autograd::variable_list(u->params.size()));
    for (size_t i = 0; i < u->params.size(); ++i) {
      auto& p = u->params[i].param;
      if (p.grad().defined()) p.mutable_grad().add_(grads[i]);
      else p.mutable_grad() = grads[i];
    }
  }
  sync_ = sync;
}

bool FullyShard::offloads(const torch::Tensor& p) const {
  return options_.offload && by_impl_.count(p.unsafeGetTensorImpl());
}

const ShardInfo* FullyShard::shard_info(const torch::Tensor& p) const {
  auto it = by_impl_.find(p.unsafeGetTensorImpl());
  return it == by_impl_.end() ? nullptr : &it->second->info;
}

std::unique_ptr<FullyShard> apply_fully_shard(models::Model& model, Group& group, const FullyShardOptions& options) {
  return std::make_unique<FullyShard>(model, group, options);
}

std::unique_ptr<FullyShard> apply_fully_shard(const std::vector<models::Root>& roots, Group& group,
                                              const FullyShardOptions& options) {
  return std::make_unique<FullyShard>(roots, group, options);
}

}  // namespace composer::parallel

#include "parallelisms/fully_shard.h"

#include <ATen/native/Resize.h>

#include "parallelisms/tensor_parallel.h"

namespace composer::parallel {

struct FullyShard::Param {
  torch::Tensor param;                 // registered; its data is this rank's shard
  std::vector<int64_t> full_shape;
  std::vector<int64_t> rows;           // dim-0 rows of every rank's shard
  int64_t row_numel = 1;
  int64_t offset = 0;                  // in the unit's per-rank flat buffer
  std::vector<nn::Module*> users;      // modules that compute with it
  torch::Tensor full;                  // the unsharded tensor while gathered
};

struct FullyShard::Unit {
  std::string name;
  nn::Module* module = nullptr;
  std::vector<Param> params;
  int64_t padded_numel = 0;            // per-rank flat size: every param's largest shard
  bool freed = false;                  // storage released after forward
  Group* group = nullptr;
  bool reshard_after_forward = true;
  const bool* sync = nullptr;          // the owner's requires-sync flag
  torch::Tensor pending;               // unreduced gradients of earlier microbatches
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t rank_offset(const std::vector<int64_t>& rows, int r) {
  int64_t o = 0;
  for (int i = 0; i < r; ++i) o += rows[i];
  return o;
}

// One all-gather of the unit's flat shards; returns every parameter's full value.
std::vector<torch::Tensor> gather_unit(FullyShard::Unit& u) {
  Group& g = *u.group;
  auto options = u.params.front().param.options().requires_grad(false);
  auto flat = torch::zeros({u.padded_numel}, options);
  for (auto& p : u.params) {
    const int64_t n = p.rows[g.rank] * p.row_numel;
    if (n) flat.narrow(0, p.offset, n).copy_(p.param.detach().reshape({-1}));
  }
  auto all = all_gather_flat(g, flat);
  std::vector<torch::Tensor> out;
  for (auto& p : u.params) {
    std::vector<torch::Tensor> pieces;
    for (int r = 0; r < g.size; ++r) pieces.push_back(all[r].narrow(0, p.offset, p.rows[r] * p.row_numel));
    out.push_back(torch::cat(pieces).view(p.full_shape));
  }
  return out;
}

// The unit's full gradients laid out as [ranks, padded shard]: row r holds
// rank r's piece of every parameter.
torch::Tensor pack_grads(FullyShard::Unit& u, const variable_list& grads) {
  Group& g = *u.group;
  auto options = u.params.front().param.options().requires_grad(false);
  auto flat = torch::zeros({g.size, u.padded_numel}, options);
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    if (!grads[i].defined()) continue;
    auto gf = grads[i].reshape({-1});
    for (int r = 0; r < g.size; ++r) {
      const int64_t n = p.rows[r] * p.row_numel;
      if (n) flat[r].narrow(0, p.offset, n).copy_(gf.narrow(0, rank_offset(p.rows, r) * p.row_numel, n));
    }
  }
  return flat;
}

// One reduce-scatter (average) of the unit's gradients, including those held
// back from earlier microbatches, into shard gradients. Without sync the
// gradients are only held back, so accumulation reduce-scatters once.
std::vector<torch::Tensor> reduce_unit(FullyShard::Unit& u, const variable_list& grads) {
  Group& g = *u.group;
  auto flat = pack_grads(u, grads);
  if (u.pending.defined()) {
    flat.add_(u.pending);
    u.pending = torch::Tensor();
  }
  if (!*u.sync) {
    u.pending = flat;
    return std::vector<torch::Tensor>(u.params.size());
  }
  auto mine = reduce_scatter_flat(g, flat, Reduce::kAvg);
  std::vector<torch::Tensor> out;
  for (auto& p : u.params) {
    auto shape = p.full_shape;
    shape[0] = p.rows[g.rank];
    out.push_back(mine.narrow(0, p.offset, p.rows[g.rank] * p.row_numel).view(shape).clone());
  }
  return out;
}

// Forward: the unit's shards -> full parameters (one all-gather).
// Backward: full gradients -> shard gradients (one reduce-scatter).
struct UnshardFn : torch::autograd::Function<UnshardFn> {
  static variable_list forward(AutogradContext* ctx, at::TensorList shards, int64_t unit) {
    ctx->saved_data["unit"] = unit;
    return gather_unit(*reinterpret_cast<FullyShard::Unit*>(unit));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& u = *reinterpret_cast<FullyShard::Unit*>(ctx->saved_data["unit"].toInt());
    auto out = reduce_unit(u, grads);
    out.push_back(torch::Tensor());
    return out;
  }
};

void free_storage(const torch::Tensor& t) {
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);
}

void unshard(FullyShard::Unit& u) {
  std::vector<torch::Tensor> shards;
  for (auto& p : u.params) shards.push_back(p.param);
  auto fulls = UnshardFn::apply(at::TensorList(shards), reinterpret_cast<int64_t>(&u));
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    p.full = fulls[i];
    for (auto* m : p.users) m->set_view(p.param, p.full);
  }
  u.freed = false;
}

// Frees the unsharded storage; autograd keeps its handles, refilled before backward.
void reshard_storage(FullyShard::Unit& u) {
  for (auto& p : u.params) free_storage(p.full);
  u.freed = true;
}

void refill_storage(FullyShard::Unit& u) {
  if (!u.freed) return;
  torch::NoGradGuard no_grad;
  auto values = gather_unit(u);
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& full = u.params[i].full;
    at::native::resize_bytes_cpu(full.storage().unsafeGetStorageImpl(), full.numel() * full.element_size());
    full.variable_data().copy_(values[i]);  // .data semantics: no version bump for saved tensors
  }
  u.freed = false;
}

bool matches_any(const std::vector<std::string>& patterns, const std::string& fqn) {
  for (const auto& p : patterns) {
    if (fqn_matches(p, fqn)) return true;
  }
  return false;
}

}  // namespace

std::optional<std::string> check_units(models::Model& model, const std::vector<std::string>& units) {
  auto modules = nn::named_modules(model);
  for (const auto& pattern : units) {
    bool found = false;
    for (auto& [name, m] : modules) found = found || (!name.empty() && fqn_matches(pattern, name));
    if (!found) return pattern + ": unit pattern matches no module of " + model.type();
  }
  return std::nullopt;
}

FullyShard::FullyShard(models::Model& model, Group& group, const FullyShardOptions& options)
    : group_(group) {
  // Units: every matching module, then the root. A parameter belongs to the
  // innermost unit whose module contains it.
  std::vector<std::pair<std::string, nn::Module*>> unit_modules;
  for (auto& [name, m] : nn::named_modules(model)) {
    if (!name.empty() && matches_any(options.units, name)) unit_modules.emplace_back(name, m);
  }
  unit_modules.emplace_back("", &model);
  std::unordered_map<const c10::TensorImpl*, std::vector<nn::Module*>> users;
  for (auto& [name, m] : nn::named_modules(model)) {
    for (auto& item : m->named_parameters(/*recurse=*/false)) users[item.value().unsafeGetTensorImpl()].push_back(m);
  }
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
  std::unordered_map<const c10::TensorImpl*, size_t> depth;
  for (size_t u = 0; u < unit_modules.size(); ++u) {
    const auto& prefix = unit_modules[u].first;
    for (auto& [name, p] : nn::unique_named_parameters(*unit_modules[u].second)) {
      auto* impl = p.unsafeGetTensorImpl();
      size_t d = prefix.empty() ? 0 : prefix.size() + 1;
      if (!owner.count(impl) || d > depth[impl]) {
        owner[impl] = u;
        depth[impl] = d;
      }
    }
  }
  for (auto& [name, m] : unit_modules) {
    auto unit = std::make_unique<Unit>();
    unit->name = name;
    unit->module = m;
    unit->group = &group_;
    unit->reshard_after_forward = options.reshard_after_forward && !name.empty();  // the root stays gathered
    unit->sync = &sync_;
    units_.push_back(std::move(unit));
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    Unit& u = *units_[owner.at(p.unsafeGetTensorImpl())];
    Param q;
    q.param = p;
    q.full_shape = p.sizes().vec();
    if (q.full_shape.empty()) q.full_shape = {1};
    q.rows = chunk_sizes(q.full_shape[0], group_.size);
    q.row_numel = p.numel() / std::max<int64_t>(1, q.full_shape[0]);
    q.offset = u.padded_numel;
    u.padded_numel += q.rows[0] * q.row_numel;
    q.users = users[p.unsafeGetTensorImpl()];
    auto local = p.detach().reshape(q.full_shape).narrow(0, rank_offset(q.rows, group_.rank), q.rows[group_.rank]);
    p.set_data(local.clone());
    u.params.push_back(q);
  }
  for (auto& u : units_) {
    for (auto& q : u->params) by_impl_[q.param.unsafeGetTensorImpl()] = &q;
  }
  for (auto& up : units_) {
    Unit* u = up.get();
    if (u->params.empty()) continue;
    u->module->add_pre_hook([u](nn::Module&, torch::Tensor x) {
      unshard(*u);  // every forward gathers the current shards
      return x;
    });
    u->module->add_post_hook([u](nn::Module&, const torch::Tensor&, torch::Tensor y) {
      if (!u->reshard_after_forward || !y.requires_grad()) return y;
      reshard_storage(*u);
      y.register_hook([u](torch::Tensor g) {
        refill_storage(*u);  // runs before this unit's backward
        return g;
      });
      return y;
    });
  }
}

FullyShard::~FullyShard() = default;

size_t FullyShard::num_units() const {
  size_t n = 0;
  for (const auto& u : units_) n += u->params.empty() ? 0 : 1;
  return n;
}

void FullyShard::reshard() {
  for (auto& u : units_) {
    for (auto& p : u->params) {
      for (auto* m : p.users) m->clear_view(p.param);
      p.full = torch::Tensor();
    }
    u->freed = false;
  }
}

bool FullyShard::is_sharded(const torch::Tensor& p) const { return by_impl_.count(p.unsafeGetTensorImpl()) > 0; }

torch::Tensor FullyShard::full(const torch::Tensor& p) {
  auto it = by_impl_.find(p.unsafeGetTensorImpl());
  if (it == by_impl_.end()) return p.detach().clone();
  const Param& q = *it->second;
  std::vector<int64_t> shape = q.full_shape;
  auto local = p.detach().reshape({q.rows[group_.rank], q.row_numel});
  auto whole = all_gather(group_, local.contiguous(), q.rows);
  return whole.view(p.dim() == 0 ? std::vector<int64_t>{} : shape).clone();
}

std::unique_ptr<FullyShard> apply_fully_shard(models::Model& model, Group& group, const FullyShardOptions& options) {
  return std::make_unique<FullyShard>(model, group, options);
}

}  // namespace composer::parallel

// The autograd-aware collectives of collectives.h: each forward collective
// with its backward (all-reduce and identity, all-gather and reduce-scatter,
// gathers along a dim with their partial-gradient taps).
#include <torch/torch.h>

#include "parallelisms/comm/collectives.h"

namespace composer::parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Group pointers travel through the context as an integer (saved_data holds IValues).
int64_t as_id(Group& g) { return reinterpret_cast<int64_t>(&g); }
Group& from_id(AutogradContext* ctx) { return *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt()); }

struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, int64_t group) {
    auto out = t.clone();
    all_reduce(*reinterpret_cast<Group*>(group), out);
    return out;
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

struct ReduceGradFn : torch::autograd::Function<ReduceGradFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, int64_t group) {
    ctx->saved_data["group"] = group;
    return t.view_as(t);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = grads[0].clone();
    all_reduce(from_id(ctx), g);
    return {g, torch::Tensor()};
  }
};

struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor input, int64_t group, std::vector<int64_t> send,
                               std::vector<int64_t> recv) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return all_to_all(*reinterpret_cast<Group*>(group), input, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    return {all_to_all(from_id(ctx), grads[0].contiguous(), recv, send), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor shard, int64_t group, std::vector<int64_t> sizes) {
    ctx->saved_data["group"] = group;
    return all_gather(*reinterpret_cast<Group*>(group), shard, sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter(from_id(ctx), grads[0]), torch::Tensor(), torch::Tensor()};
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor full, int64_t group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["rows"] = full.size(0);
    return reduce_scatter(*reinterpret_cast<Group*>(group), full);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = from_id(ctx);
    auto sizes = chunk_sizes(ctx->saved_data["rows"].toInt(), g.size);
    return {all_gather(g, grads[0].contiguous(), sizes), torch::Tensor()};
  }
};

torch::Tensor slice_dim(Group& g, const torch::Tensor& t, int64_t dim) {
  auto sizes = chunk_sizes(t.size(dim), g.size);
  return t.narrow(dim, offset_of(sizes, g.rank), sizes[g.rank]);
}

struct GatherAlongFn : torch::autograd::Function<GatherAlongFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, int64_t group, int64_t dim, int64_t global,
                               bool reduce) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["reduce"] = reduce;
    return gather_dim(*reinterpret_cast<Group*>(group), t, dim, global);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = from_id(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    auto gi = ctx->saved_data["reduce"].toBool() ? reduce_scatter_dim(g, grads[0], dim)
                                                 : slice_dim(g, grads[0], dim).contiguous();
    return {gi, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The partial-gradient state is saved with each node as a capsule.
struct PartialsHolder : torch::CustomClassHolder {
  std::shared_ptr<PartialGrads> partials;
};

struct GatherPartialsFn : torch::autograd::Function<GatherPartialsFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, int64_t group, int64_t dim, int64_t global,
                               c10::intrusive_ptr<PartialsHolder> holder) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["partials"] = c10::IValue::make_capsule(holder);
    ctx->set_materialize_grads(false);  // no ordinary gradient: only the partials
    return gather_dim(*reinterpret_cast<Group*>(group), t, dim, global);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = from_id(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    auto holder = c10::static_intrusive_pointer_cast<PartialsHolder>(ctx->saved_data["partials"].toCapsule());
    torch::Tensor partial = std::move(holder->partials->sum);  // leaves it undefined for the next pass
    torch::Tensor gi;
    if (partial.defined()) gi = reduce_scatter_dim(g, partial, dim);
    if (grads[0].defined()) {
      auto local = slice_dim(g, grads[0], dim);
      gi = gi.defined() ? gi + local : local.contiguous();
    }
    return {gi, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct TapPartialFn : torch::autograd::Function<TapPartialFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, c10::intrusive_ptr<PartialsHolder> holder) {
    ctx->saved_data["partials"] = c10::IValue::make_capsule(holder);
    return t.view_as(t);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<PartialsHolder>(ctx->saved_data["partials"].toCapsule());
    auto& sum = holder->partials->sum;
    if (grads[0].defined()) sum = sum.defined() ? sum + grads[0] : grads[0];
    return {torch::Tensor(), torch::Tensor()};
  }
};

struct ScatterAlongFn : torch::autograd::Function<ScatterAlongFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, int64_t group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["global"] = t.size(dim);
    return slice_dim(*reinterpret_cast<Group*>(group), t, dim).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto gi = gather_dim(from_id(ctx), grads[0], ctx->saved_data["dim"].toInt(), ctx->saved_data["global"].toInt());
    return {gi, torch::Tensor(), torch::Tensor()};
  }
};

struct ReduceScatterAlongFn : torch::autograd::Function<ReduceScatterAlongFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor t, int64_t group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["global"] = t.size(dim);
    return reduce_scatter_dim(*reinterpret_cast<Group*>(group), t, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto gi = gather_dim(from_id(ctx), grads[0], ctx->saved_data["dim"].toInt(), ctx->saved_data["global"].toInt());
    return {gi, torch::Tensor(), torch::Tensor()};
  }
};

// A meta tensor on a group with a process group (a pipeline sizing its stages
// on a model built on meta) gets the output's shape, `size` along `dim`,
// without communicating or autograd. Without a process group (a dry run) the
// autograd functions run, moving nothing and counting what they would move.
torch::Tensor meta_resized(const torch::Tensor& t, int64_t dim, int64_t size) {
  auto shape = t.sizes().vec();
  shape[dim] = size;
  return torch::empty(shape, t.options());
}

}  // namespace

torch::Tensor gather_along(Group& g, const torch::Tensor& t, int64_t dim, int64_t global, bool backward_reduce) {
  if (g.size == 1) return t;
  dim = dim < 0 ? dim + t.dim() : dim;
  if (t.is_meta() && g.pg) return meta_resized(t, dim, global);
  return GatherAlongFn::apply(t, as_id(g), dim, global, backward_reduce);
}

torch::Tensor gather_along_partials(Group& g, const torch::Tensor& t, int64_t dim, int64_t global,
                                    std::shared_ptr<PartialGrads> partials) {
  if (g.size == 1) return t;
  dim = dim < 0 ? dim + t.dim() : dim;
  if (t.is_meta() && g.pg) return meta_resized(t, dim, global);
  partials->collecting = t.requires_grad() && torch::GradMode::is_enabled();
  auto holder = c10::make_intrusive<PartialsHolder>();
  holder->partials = std::move(partials);
  return GatherPartialsFn::apply(t, as_id(g), dim, global, holder);
}

torch::Tensor tap_partial(const torch::Tensor& t, std::shared_ptr<PartialGrads> partials) {
  auto holder = c10::make_intrusive<PartialsHolder>();
  holder->partials = std::move(partials);
  return TapPartialFn::apply(t, holder);
}

torch::Tensor scatter_along(Group& g, const torch::Tensor& t, int64_t dim) {
  if (g.size == 1) return t;
  dim = dim < 0 ? dim + t.dim() : dim;
  if (t.is_meta() && g.pg) return meta_resized(t, dim, chunk_sizes(t.size(dim), g.size)[g.rank]);
  return ScatterAlongFn::apply(t, as_id(g), dim);
}

torch::Tensor reduce_scatter_along(Group& g, const torch::Tensor& t, int64_t dim) {
  if (g.size == 1) return t;
  dim = dim < 0 ? dim + t.dim() : dim;
  if (t.is_meta() && g.pg) return meta_resized(t, dim, chunk_sizes(t.size(dim), g.size)[g.rank]);
  return ReduceScatterAlongFn::apply(t, as_id(g), dim);
}

torch::Tensor all_to_all_autograd(Group& g, const torch::Tensor& input, const std::vector<int64_t>& send_counts,
                                  const std::vector<int64_t>& recv_counts) {
  return AllToAllFn::apply(input, as_id(g), send_counts, recv_counts);
}

torch::Tensor all_reduce_autograd(Group& g, const torch::Tensor& t) {
  if (t.is_meta() && g.pg) return t.clone();
  return g.size == 1 ? t : AllReduceFn::apply(t, as_id(g));
}
torch::Tensor reduce_grad_autograd(Group& g, const torch::Tensor& t) {
  return g.size == 1 || (t.is_meta() && g.pg) ? t : ReduceGradFn::apply(t, as_id(g));
}
torch::Tensor all_gather_autograd(Group& g, const torch::Tensor& shard, const std::vector<int64_t>& sizes) {
  return AllGatherFn::apply(shard, as_id(g), sizes);
}
torch::Tensor reduce_scatter_autograd(Group& g, const torch::Tensor& full) {
  return ReduceScatterFn::apply(full, as_id(g));
}

}  // namespace composer::parallel

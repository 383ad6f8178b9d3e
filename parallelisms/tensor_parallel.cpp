#include "parallelisms/tensor_parallel.h"

#include <unordered_set>

#include "models/layers.h"

namespace composer::parallel {
namespace {

using models::Layout;
using models::TpRule;
using models::TpStyle;

const char* style_name(TpStyle s) {
  switch (s) {
    case TpStyle::kColwise: return "colwise";
    case TpStyle::kRowwise: return "rowwise";
    case TpStyle::kSequenceParallel: return "sequence_parallel";
    case TpStyle::kPrepareInput: return "prepare_input";
  }
  return "?";
}

bool is_norm(nn::Module* m) {
  return dynamic_cast<nn::LayerNorm*>(m) || dynamic_cast<nn::RMSNorm*>(m);
}

std::optional<std::string> unsuitable(const TpRule& r, nn::Module* m) {
  const bool linear = dynamic_cast<nn::Linear*>(m) != nullptr;
  const bool embedding = dynamic_cast<nn::Embedding*>(m) != nullptr;
  switch (r.style) {
    case TpStyle::kColwise:
      if (!linear) return "colwise needs a Linear, not a " + m->type();
      break;
    case TpStyle::kRowwise:
      if (!linear && !embedding) return "rowwise needs a Linear or an Embedding, not a " + m->type();
      if (embedding && r.input.sharded) return "a rowwise Embedding takes replicated token ids";
      break;
    case TpStyle::kSequenceParallel:
      if (!is_norm(m)) return "sequence_parallel needs a LayerNorm or RMSNorm, not a " + m->type();
      break;
    case TpStyle::kPrepareInput: break;
  }
  return std::nullopt;
}

// This parameter's tp dim in its spec (Replicate until a rule says otherwise).
SpecDim& tp_dim(TensorParallel& tp, const torch::Tensor& p) {
  ShardSpec& spec = tp.placements().of(p);
  Group& g = tp.group();
  if (SpecDim* d = spec.find(g.name)) return *d;
  spec.dims.push_back({g.name, &g, g.size, g.rank, Placement::replicate(), Placement::replicate()});
  return spec.dims.back();
}

// Replaces a parameter's data by this rank's torch.chunk piece of `dim`.
void shard_param(TensorParallel& tp, torch::Tensor& p, int64_t dim) {
  auto* impl = p.unsafeGetTensorImpl();
  auto it = tp.shards_.find(impl);
  if (it != tp.shards_.end()) {
    TORCH_CHECK(it->second.dim == dim, "a tied parameter is sharded on two different dims by the plan");
    return;  // a tied weight, already sharded
  }
  Group& g = tp.group();
  auto sizes = chunk_sizes(p.size(dim), g.size);
  int64_t start = 0;
  for (int i = 0; i < g.rank; ++i) start += sizes[i];
  TpShard s{dim, p.size(dim)};
  SpecDim& d = tp_dim(tp, p);
  d.param = d.grad = Placement::shard(dim);
  torch::NoGradGuard no_grad;
  p.set_data(p.detach().narrow(dim, start, sizes[g.rank]).clone());
  tp.shards_[impl] = s;
}

// A replicated parameter computed with sharded activations gets partial
// gradients: they are summed over tp (by the gradient synchronisation).
void partial_grads_over_tp(TensorParallel& tp, torch::Tensor& p) {
  SpecDim& d = tp_dim(tp, p);
  if (!d.param.is_shard()) d.grad = Placement::partial(Reduce::kSum);
}

torch::Tensor redistribute_output(Group& g, torch::Tensor y, const Layout& out) {
  return out.sharded ? reduce_scatter_along(g, y, out.dim) : all_reduce_autograd(g, y);
}

void apply_colwise(TensorParallel& tp, nn::Linear& m, const TpRule& r) {
  Group& g = tp.group();
  shard_param(tp, m.weight, 0);
  if (m.bias.defined()) shard_param(tp, m.bias, 0);
  const int64_t out_features = m.out_features;
  const Layout in = r.input, out = r.output;
  m.add_pre_hook([&g, in, gathered = tp.gathered_](nn::Module&, torch::Tensor x) {
    if (in.sharded) return gather_along(g, x, in.dim, x.size(in.dim) * g.size, /*backward_reduce=*/true);
    // A replicated input that a prepare_input gather made: its gradient here
    // is partial over tp, and the gather reduce-scatters the sum of all such
    // (once, not one all-reduce per Linear).
    for (const auto& slot : *gathered) {
      if (slot->tensor.lock().get() == x.unsafeGetTensorImpl()) return tap_partial(x, slot->partials);
    }
    return reduce_grad_autograd(g, x);
  });
  if (!out.sharded) {
    m.add_post_hook([&g, out_features](nn::Module&, const torch::Tensor&, torch::Tensor y) {
      return gather_along(g, y, -1, out_features, /*backward_reduce=*/false);
    });
  }
}

void apply_rowwise_linear(TensorParallel& tp, nn::Linear& m, const TpRule& r) {
  Group& g = tp.group();
  shard_param(tp, m.weight, 1);
  const Layout in = r.input, out = r.output;
  const bool bias = m.bias.defined();
  if (bias) {
    m.bias_after = true;  // the layer computes without bias; it is added after the reduction
    if (out.sharded) partial_grads_over_tp(tp, m.bias);
  }
  if (!in.sharded) {
    m.add_pre_hook([&g](nn::Module&, torch::Tensor x) { return scatter_along(g, x, -1); });
  }
  m.add_post_hook([&g, out, bias, &m](nn::Module&, const torch::Tensor&, torch::Tensor y) {
    y = redistribute_output(g, y, out);
    return bias ? y + m.param(m.bias) : y;  // param(): the value a later transform (fully_shard) installed
  });
}

void apply_rowwise_embedding(TensorParallel& tp, nn::Embedding& m, const TpRule& r) {
  Group& g = tp.group();
  auto sizes = chunk_sizes(m.num_embeddings, g.size);
  int64_t start = 0;
  for (int i = 0; i < g.rank; ++i) start += sizes[i];
  const int64_t len = sizes[g.rank];
  shard_param(tp, m.weight, 0);
  auto mask = std::make_shared<torch::Tensor>();
  const Layout out = r.output;
  m.add_pre_hook([start, len, mask, &m](nn::Module&, torch::Tensor ids) {
    // No rows here: look up a zero row (made at the first forward, once the
    // weight has its values' device and dtype).
    if (len == 0 && m.param(m.weight).numel() == 0) {
      m.set_view(m.weight, torch::zeros({1, m.embedding_dim}, m.weight.options()));
    }
    *mask = (ids < start) | (ids >= start + len);  // bitwise on bools: it has a meta kernel
    return (ids - start).masked_fill(*mask, 0);
  });
  m.add_post_hook([&g, out, mask](nn::Module&, const torch::Tensor&, torch::Tensor y) {
    y = y.masked_fill(mask->unsqueeze(-1), 0);
    return redistribute_output(g, y, out);
  });
}

void apply_rule(TensorParallel& tp, const TpRule& r, nn::Module& m) {
  Group& g = tp.group();
  switch (r.style) {
    case TpStyle::kColwise: apply_colwise(tp, dynamic_cast<nn::Linear&>(m), r); break;
    case TpStyle::kRowwise:
      if (auto* lin = dynamic_cast<nn::Linear*>(&m)) apply_rowwise_linear(tp, *lin, r);
      else apply_rowwise_embedding(tp, dynamic_cast<nn::Embedding&>(m), r);
      break;
    case TpStyle::kSequenceParallel:
      for (auto& item : m.named_parameters(/*recurse=*/false)) partial_grads_over_tp(tp, item.value());
      break;
    case TpStyle::kPrepareInput: {
      const Layout in = r.input, want = r.desired_input;
      if (in == want) break;
      auto slot = std::make_shared<TensorParallel::Gathered>();
      tp.gathered_->push_back(slot);
      m.add_pre_hook([&g, in, want, slot](nn::Module&, torch::Tensor x) {
        if (in.sharded && !want.sharded) {
          // Its users' gradients: the colwise Linears' partial ones are
          // reduce-scattered, any other user's (already replicated) sliced.
          slot->partials = std::make_shared<PartialGrads>();
          auto y = gather_along_partials(g, x, in.dim, x.size(in.dim) * g.size, slot->partials);
          const bool collects = slot->partials->collecting;
          slot->tensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
              collects ? y.getIntrusivePtr() : c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
          return y;
        }
        TORCH_CHECK(!in.sharded && want.sharded, "prepare_input supports Shard -> Replicate and Replicate -> Shard");
        return scatter_along(g, x, want.dim);
      });
      break;
    }
  }
}

}  // namespace

std::optional<std::string> check_tp_plan(models::Model& model, const models::TpPlan& plan) {
  auto modules = nn::named_modules(model);
  for (const auto& r : plan) {
    bool matched = false;
    for (auto& [name, m] : modules) {
      if (!models::fqn_matches(r.pattern, name)) continue;
      matched = true;
      if (auto why = unsuitable(r, m)) return r.pattern + ": " + *why + " (module " + name + ")";
    }
    if (!matched) return r.pattern + ": " + style_name(r.style) + " pattern matches no module of " + model.type();
  }
  return std::nullopt;
}

const TpShard* TensorParallel::shard_of(const torch::Tensor& p) const {
  auto it = shards_.find(p.unsafeGetTensorImpl());
  return it == shards_.end() ? nullptr : &it->second;
}

std::unique_ptr<TensorParallel> apply_tensor_parallel(const std::vector<models::Root>& roots, Group& group,
                                                      const models::TpPlan& plan, Placements& placements) {
  auto tp = std::make_unique<TensorParallel>(group, placements);
  models::NamedModules modules;  // every root's modules once (a module two local stages share)
  std::unordered_set<const nn::Module*> seen;
  for (const auto& root : roots) {
    for (const auto& [name, m] : root.modules) {
      if (seen.insert(m).second) modules.emplace_back(name, m);
    }
  }
  for (const auto& r : plan) {
    for (auto& [name, m] : modules) {
      if (models::fqn_matches(r.pattern, name)) apply_rule(*tp, r, *m);
    }
  }
  for (auto& [name, p] : models::root_parameters(roots)) tp_dim(*tp, p);  // the rest: replicated over tp
  for (auto& [name, m] : modules) {
    bool styled = false;
    for (const auto& r : plan) styled = styled || models::fqn_matches(r.pattern, name);
    tp->modules_ += styled ? 1 : 0;
  }
  return tp;
}

std::unique_ptr<TensorParallel> apply_tensor_parallel(models::Model& model, Group& group, const models::TpPlan& plan,
                                                      Placements& placements) {
  return apply_tensor_parallel({models::whole(model)}, group, plan, placements);
}

}  // namespace composer::parallel

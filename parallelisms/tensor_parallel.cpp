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
    case TpStyle::kSharedInput: return "shared_input";
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
    case TpStyle::kPrepareInput:
    case TpStyle::kSharedInput: break;
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
  const int64_t start = offset_of(sizes, g.rank);
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

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Group& group_of(AutogradContext* ctx) { return *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt()); }

// Whether a Linear's collective runs fused with its matmul (async TP) now.
// Not while a zero-bubble pipeline defers weight gradients (its W action
// needs the layer's own record: Linear::forward then ignores `fused`), nor
// for a meta tensor on a group with a process group (a pipeline sizing its
// stages, which the hooks' collectives answer without communicating).
// Nor for a float8 layer (train.fp8), whose matmul is float8's.
bool fuses(const Group& g, const torch::Tensor& x, const nn::Linear& m) {
  // A LoRA adapter computes beside the matmul, on the gathered input and before the reduction.
  return g.size > 1 && !m.fp8 && !m.lora_A.defined() && !nn::DeferWeightGrads::active() && !(x.is_meta() && g.pg);
}

// A float8 layer's scales over the whole of the operands tp shards: the largest magnitude over the group.
void reduce_fp8_amax(Group& g, nn::Linear& m, std::vector<nn::Fp8Operand> sharded) {
  if (g.size == 1) return;
  m.fp8_amax = [&g, sharded](torch::Tensor& amax, nn::Fp8Operand which) {
    if (std::find(sharded.begin(), sharded.end(), which) == sharded.end()) return;
    // A meta tensor on a connected group (a pipeline sizing its stages): nothing to reduce. A dry run's
    // groups are not connected, and count the all-reduce for the estimate.
    if (amax.is_meta() && g.pg) return;
    all_reduce(g, amax, Reduce::kMax);
  };
}

// A colwise Linear whose input is sharded along `dim`: y = linear(gather(x)),
// each gathered piece multiplied while the next one moves. Backward
// reduce-scatters the input's gradient, each rank's addend of a piece
// (grad_y's rows of it times w) computed while the sum before it moves; the
// weight's and bias's gradients come from the gathered input, as autograd's
// linear backward computes them.
struct GatherLinearFn : torch::autograd::Function<GatherLinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& b, int64_t group, int64_t dim) {
    Group& g = *reinterpret_cast<Group*>(group);
    const int64_t global = x.size(dim) * g.size;
    const torch::Tensor bias = b ? *b : torch::Tensor();
    std::vector<torch::Tensor> ys(g.size);
    auto saved = gather_along_each(g, x, dim, global,
                                   [&](int i, const torch::Tensor& piece) { ys[i] = torch::linear(piece, w, bias); });
    saved.push_back(w);
    ctx->save_for_backward(saved);
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["global"] = global;
    ctx->saved_data["bias"] = b.has_value();  // an absent bias is no input of the node
    return torch::cat(ys, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = group_of(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt(), global = ctx->saved_data["global"].toInt();
    auto xs = ctx->get_saved_variables();
    const torch::Tensor w = xs.back();
    xs.pop_back();
    const torch::Tensor& gy = grads[0];
    const auto sizes = chunk_sizes(global, g.size);
    torch::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) {
      gx = reduce_scatter_computed(g, dim, global, [&](int i) {
        return torch::matmul(gy.narrow(dim, offset_of(sizes, i), sizes[i]), w);
      });
    }
    auto g2 = gy.reshape({-1, w.size(0)});
    if (ctx->needs_input_grad(1)) gw = nn::linear_weight_grad(w, torch::cat(xs, dim).reshape({-1, w.size(1)}), g2);
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) gb = g2.sum(0);
    return {gx, gw, gb, torch::Tensor(), torch::Tensor()};
  }
};

// A rowwise Linear whose output is sharded along `dim` (its bias added after):
// y = reduce_scatter(linear(x)), each rank's addend of a piece (x's rows of it
// times w) computed while the sum before it moves. Backward gathers the
// output's gradient, multiplying each piece while the next one moves.
struct LinearReduceScatterFn : torch::autograd::Function<LinearReduceScatterFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, int64_t group,
                               int64_t dim) {
    Group& g = *reinterpret_cast<Group*>(group);
    const int64_t global = x.size(dim);
    const auto sizes = chunk_sizes(global, g.size);
    ctx->save_for_backward({x, w});
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["global"] = global;
    return reduce_scatter_computed(g, dim, global, [&](int i) {
      return torch::linear(x.narrow(dim, offset_of(sizes, i), sizes[i]), w);
    });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = group_of(ctx);
    const int64_t dim = ctx->saved_data["dim"].toInt(), global = ctx->saved_data["global"].toInt();
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const bool need_x = ctx->needs_input_grad(0);
    std::vector<torch::Tensor> gxs(g.size);
    auto gys = gather_along_each(g, grads[0], dim, global, [&](int i, const torch::Tensor& piece) {
      if (need_x) gxs[i] = torch::matmul(piece, w);
    });
    torch::Tensor gx, gw;
    if (need_x) gx = torch::cat(gxs, dim);
    if (ctx->needs_input_grad(1)) {
      gw = nn::linear_weight_grad(w, x.reshape({-1, w.size(1)}), torch::cat(gys, dim).reshape({-1, w.size(0)}));
    }
    return {gx, gw, torch::Tensor(), torch::Tensor()};
  }
};

torch::Tensor redistribute_output(Group& g, torch::Tensor y, const Layout& out) {
  return out.sharded ? reduce_scatter_along(g, y, out.dim) : all_reduce_autograd(g, y);
}

void apply_colwise(TensorParallel& tp, nn::Linear& m, const TpRule& r) {
  Group& g = tp.group();
  shard_param(tp, m.weight, 0);
  if (m.bias.defined()) shard_param(tp, m.bias, 0);
  if (m.lora_A.defined()) {  // A whole (its gradient summed over tp: each rank's rows of B), B split as the base
    partial_grads_over_tp(tp, m.lora_A);
    shard_param(tp, m.lora_B, 0);
  }
  const int64_t out_features = m.out_features;
  const Layout in = r.input, out = r.output;
  reduce_fp8_amax(g, m, {nn::Fp8Operand::kWeight, nn::Fp8Operand::kGradOutput});
  m.add_pre_hook([&g, &m, in, gathered = tp.gathered_](nn::Module&, torch::Tensor x) {
    if (in.sharded) {
      return fuses(g, x, m) ? x : gather_along(g, x, in.dim, x.size(in.dim) * g.size, /*backward_reduce=*/true);
    }
    // A replicated input that a prepare_input gather made: its gradient here
    // is partial over tp, and the gather reduce-scatters the sum of all such
    // (once, not one all-reduce per Linear).
    for (const auto& slot : *gathered) {
      if (slot->tensor.lock().get() == x.unsafeGetTensorImpl()) return tap_partial(x, slot->partials);
    }
    return reduce_grad_autograd(g, x);
  });
  if (in.sharded) {  // the gather fused with the matmul
    m.fused = [&g, &m, in](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
      if (!fuses(g, x, m)) return torch::Tensor();
      const int64_t dim = in.dim < 0 ? in.dim + x.dim() : in.dim;
      return GatherLinearFn::apply(x, w, b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt, reinterpret_cast<int64_t>(&g), dim);
    };
  }
  if (!out.sharded) {
    m.add_post_hook([&g, out_features](nn::Module&, const torch::Tensor&, torch::Tensor y) {
      return gather_along(g, y, -1, out_features, /*backward_reduce=*/false);
    });
  }
}

void apply_rowwise_linear(TensorParallel& tp, nn::Linear& m, const TpRule& r) {
  Group& g = tp.group();
  shard_param(tp, m.weight, 1);
  if (m.lora_A.defined()) {  // A split on the base's input columns, B whole (its gradient summed over tp)
    shard_param(tp, m.lora_A, 1);
    partial_grads_over_tp(tp, m.lora_B);
  }
  reduce_fp8_amax(g, m, {nn::Fp8Operand::kInput, nn::Fp8Operand::kWeight});
  const Layout in = r.input, out = r.output;
  const bool bias = m.bias.defined();
  if (bias) {
    m.bias_after = true;  // the layer computes without bias; it is added after the reduction
    if (out.sharded) partial_grads_over_tp(tp, m.bias);
  }
  if (!in.sharded) {
    m.add_pre_hook([&g](nn::Module&, torch::Tensor x) { return scatter_along(g, x, -1); });
  }
  if (out.sharded) {  // the reduce-scatter fused with the matmul
    m.fused = [&g, &m, out](const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor&) {
      if (!fuses(g, x, m)) return torch::Tensor();
      return LinearReduceScatterFn::apply(x, w, reinterpret_cast<int64_t>(&g), out.dim < 0 ? out.dim + x.dim() : out.dim);
    };
  }
  m.add_post_hook([&g, out, bias, &m](nn::Module&, const torch::Tensor& x, torch::Tensor y) {
    if (!(out.sharded && fuses(g, x, m))) y = redistribute_output(g, y, out);
    return bias ? y + m.param(m.bias) : y;  // param(): the value a later transform (fully_shard) installed
  });
}

void apply_rowwise_embedding(TensorParallel& tp, nn::Embedding& m, const TpRule& r) {
  Group& g = tp.group();
  auto sizes = chunk_sizes(m.num_embeddings, g.size);
  const int64_t start = offset_of(sizes, g.rank);
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
    case TpStyle::kSharedInput:  // Megatron's copy to the tensor-parallel region: forward as is
      m.add_pre_hook([&g](nn::Module&, torch::Tensor x) { return reduce_grad_autograd(g, x); });
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

// Each row's softmax terms over the whole vocabulary from this rank's piece of the logits (rows x its
// columns): exp(logit - the row's max), their sum over every piece, the target's shifted logit
// (from the rank whose piece holds it), and where the target lies in this piece.
struct VocabParallelTerms {
  torch::Tensor exp, sum, picked, local, mine;
  // Each row's -log softmax(logits)[target].
  torch::Tensor nll() const { return sum.log() - picked; }
};

VocabParallelTerms vocab_parallel_terms(Group& g, int64_t vocab, const torch::Tensor& logits,
                                        const torch::Tensor& targets) {
  const auto sizes = chunk_sizes(vocab, g.size);
  const int64_t start = offset_of(sizes, g.rank);
  const int64_t rows = logits.size(0), len = logits.size(1);
  // Each row's max over the whole vocabulary (an empty piece offers -inf).
  torch::Tensor max = len ? std::get<0>(logits.max(1)) : torch::full({rows}, -INFINITY, logits.options());
  all_reduce(g, max, Reduce::kMax);
  auto shifted = logits - max.unsqueeze(1);
  VocabParallelTerms t;
  t.exp = shifted.exp();
  // The target's shifted logit, from the rank whose piece holds it (0 elsewhere).
  t.mine = (targets >= start) & (targets < start + len);
  t.local = (targets - start).masked_fill(~t.mine, 0);
  auto picked = len ? shifted.gather(1, t.local.unsqueeze(1)).squeeze(1).masked_fill(~t.mine, 0)
                    : torch::zeros({rows}, logits.options());
  auto both = torch::stack({t.exp.sum(1), picked});  // one all-reduce for the two sums
  all_reduce(g, both);
  t.sum = both[0];
  t.picked = both[1];
  return t;
}

struct VocabParallelCrossEntropyFn : torch::autograd::Function<VocabParallelCrossEntropyFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor targets, int64_t group,
                               int64_t vocab, bool sum_kept) {
    const VocabParallelTerms t = vocab_parallel_terms(*reinterpret_cast<Group*>(group), vocab, logits, targets);
    if (sum_kept) {  // the sum over the rows whose target is not -100 (ignored)
      auto keep = (targets != -100).to(logits.scalar_type());
      ctx->save_for_backward({t.exp / t.sum.unsqueeze(1), t.local, t.mine, keep});
      return (t.nll() * keep).sum();
    }
    ctx->save_for_backward({t.exp / t.sum.unsqueeze(1), t.local, t.mine});
    return t.nll().mean();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &softmax = saved[0], &local = saved[1], &mine = saved[2];
    auto grad = softmax.clone();
    if (grad.size(1)) {
      grad.scatter_add_(1, local.unsqueeze(1), -mine.to(grad.scalar_type()).unsqueeze(1));
    }
    if (saved.size() == 4) {
      grad.mul_(saved[3].unsqueeze(1) * grads[0]);
    } else {
      grad.mul_(grads[0] / static_cast<double>(std::max<int64_t>(1, grad.size(0))));
    }
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const VocabParallel& v, const torch::Tensor& logits,
                                           const torch::Tensor& targets, bool sum_kept) {
  return VocabParallelCrossEntropyFn::apply(logits, targets, reinterpret_cast<int64_t>(v.group), v.vocab, sum_kept);
}

torch::Tensor vocab_parallel_token_nll(const VocabParallel& v, const torch::Tensor& logits,
                                       const torch::Tensor& targets) {
  return vocab_parallel_terms(*v.group, v.vocab, logits, targets).nll();
}

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

bool apply(Applying& a, const TensorParallelConfig& config) {
  Group& group = a.group(config.mesh_dim);
  a.par.tp = apply_tensor_parallel(a.par.roots, group, config.rules, *a.par.placements);
  for (const auto& root : a.par.roots) {  // a pipeline rank without the logits computes no loss
    for (const auto& [name, m] : root.modules) {
      auto* out = name == config.loss_module ? dynamic_cast<nn::Linear*>(m) : nullptr;
      if (out) a.par.vocab = {&group, out->out_features};
    }
  }
  a.log("applied tensor_parallel " + over(&group) + ": " + std::to_string(a.par.tp->num_modules()) + " modules");
  return true;
}

void trace(Tracing& t, const TensorParallelConfig& config) {
  t.keep.push_back(std::shared_ptr<TensorParallel>(
      apply_tensor_parallel(t.roots, t.group(config.mesh_dim), config.rules, t.scratch)));
}

}  // namespace composer::parallel

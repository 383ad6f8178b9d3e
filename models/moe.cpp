#include "models/moe.h"

#include <ATen/ops/_grouped_mm.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace composer::models {

using nn::Linear;

FeedForward::FeedForward(int64_t dim, int64_t hidden) : Module("FeedForward") {
  w1 = add("w1", std::make_shared<Linear>(dim, hidden, false));
  w2 = add("w2", std::make_shared<Linear>(hidden, dim, false));
  w3 = add("w3", std::make_shared<Linear>(dim, hidden, false));
}

torch::Tensor FeedForward::forward(torch::Tensor x) { return (*w2)(torch::silu((*w1)(x)) * (*w3)(x)); }

namespace {

// y = each group's rows of x [rows, in] times its expert's w [experts, out, in] transposed, the
// groups ending at offs (int32, cumulative); backward as the per-expert products' backward is
// (autograd's mm backward, so that the CPU's values are the per-expert ones bit for bit), grouped:
// dx = g w per group, dw[e] = (x^T g)^T over expert e's rows.
struct GroupedLinearFn : torch::autograd::Function<GroupedLinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& offs) {
    ctx->save_for_backward({x, w, offs});
    return at::_grouped_mm(x, w.transpose(1, 2), offs);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &offs = saved[2];
    const auto g = grads[0].contiguous();
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = at::_grouped_mm(g, w, offs);
    if (ctx->needs_input_grad(1)) dw = at::_grouped_mm(x.t(), g, offs).transpose(1, 2);
    return {dx, dw, torch::Tensor()};
  }
};

// An expert weight in the rows' dtype: under fully_shard's param_dtype every other weight arrives
// cast; the experts do too, unless fully_shard left them alone (it borrowed expert_parallel's dim),
// when this cast is the policy's.
torch::Tensor expert_weight_as_rows(const torch::Tensor& w, const torch::Tensor& x) {
  return w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type());
}

}  // namespace

GroupedExperts::GroupedExperts(int64_t experts, int64_t dim, int64_t hidden, bool grouped)
    : Module("GroupedExperts"), grouped(grouped) {
  auto zero = [](torch::Tensor& w) { w.zero_(); };  // the block draws them (its depth-scaled init)
  w1 = register_parameter("w1", nn::new_param({experts, hidden, dim}, zero));
  w2 = register_parameter("w2", nn::new_param({experts, dim, hidden}, zero));
  w3 = register_parameter("w3", nn::new_param({experts, hidden, dim}, zero));
}

bool GroupedExperts::grouped_kernel_holds(const torch::Tensor& x) const {
  // ATen's grouped product takes rows whose strides are 16-byte multiples, in bfloat16, float16 or
  // float32; on CUDA only bfloat16 has its kernel (ATen runs the others as a loop that reads the
  // offsets back to the host), from 16-byte aligned rows.
  const auto dtype = x.scalar_type();
  if (dtype != torch::kFloat && dtype != torch::kBFloat16 && dtype != torch::kHalf) return false;
  const auto& w = param(w1);
  const int64_t align = 16 / static_cast<int64_t>(x.element_size()), dim = w.size(2), hidden = w.size(1);
  if (dim % align != 0 || hidden % align != 0) return false;
  if (x.is_cpu() || x.is_meta()) return true;  // the CPU's kernel is the per-expert products, in one call
  return x.is_cuda() && dtype == torch::kBFloat16 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
}

torch::Tensor GroupedExperts::run(const torch::Tensor& x, const std::vector<int64_t>& counts) {
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == param(w1).size(0), "GroupedExperts: ", counts.size(),
              " counts for ", param(w1).size(0), " experts");
  std::vector<int32_t> ends(counts.size());
  int64_t at = 0;
  for (size_t j = 0; j < counts.size(); ++j) ends[j] = static_cast<int32_t>(at += counts[j]);
  TORCH_CHECK(at == x.size(0), "GroupedExperts: counts sum to ", at, " but ", x.size(0), " rows came");
  // No rows (an expert-parallel rank nobody routed to): the per-expert path's empty product.
  if (!grouped || x.size(0) == 0) return run_each(x, counts);
  const auto rows = x.contiguous();
  if (!grouped_kernel_holds(rows)) return run_each(rows, counts);
  auto offs = torch::tensor(ends, torch::kInt32).to(x.device(), /*non_blocking=*/true);
  // Contiguous, as the kernel reads them.
  auto weight = [&](const torch::Tensor& w) { return expert_weight_as_rows(w, x).contiguous(); };
  auto h = torch::silu(GroupedLinearFn::apply(rows, weight(param(w1)), offs)) *
           GroupedLinearFn::apply(rows, weight(param(w3)), offs);
  return GroupedLinearFn::apply(h, weight(param(w2)), offs);
}

torch::Tensor GroupedExperts::run_each(const torch::Tensor& x, const std::vector<int64_t>& counts) {
  // One unbind per weight: backward stacks the experts' gradients once
  // (selecting each expert would make a zero-filled whole per expert).
  const auto a = expert_weight_as_rows(param(w1), x).unbind(0), b = expert_weight_as_rows(param(w2), x).unbind(0),
             c = expert_weight_as_rows(param(w3), x).unbind(0);
  std::vector<torch::Tensor> outs;
  int64_t at = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (counts[j] == 0) continue;
    auto rows = x.narrow(0, at, counts[j]);
    outs.push_back(torch::linear(torch::silu(torch::linear(rows, a[j])) * torch::linear(rows, c[j]), b[j]));
    at += counts[j];
  }
  if (outs.empty()) {
    // No rows: an empty product through the first expert, so every expert's
    // weights still get a gradient, of zeros, as on one device (the
    // optimizer's momentum and decay then step them there too).
    auto none = x.narrow(0, 0, 0);
    return torch::linear(torch::silu(torch::linear(none, a[0])) * torch::linear(none, c[0]), b[0]);
  }
  return outs.size() == 1 ? outs[0] : torch::cat(outs, 0);
}

torch::Tensor GroupedExperts::forward(torch::Tensor x) { return run(x, {x.size(0)}); }

namespace {

// Forward identity for the block's output; backward also gives the
// load-balancing loss `aux` the gradient `weight`, as if weight x aux were
// part of the loss.
struct AuxLossFn : torch::autograd::Function<AuxLossFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& out, const torch::Tensor& aux,
                               double weight) {
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["aux"] = aux.detach();
    return out.view_as(out);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto aux = ctx->saved_data["aux"].toTensor();
    return {grads[0], torch::full_like(aux, ctx->saved_data["weight"].toDouble()), torch::Tensor()};
  }
};

// Per sequence (rows of [B, S, ...]) and expert: whether each row of the
// expert-sorted order is within the expert's capacity for its sequence.
torch::Tensor within_capacity(const torch::Tensor& expert, const torch::Tensor& token, int64_t seq_len,
                              int64_t sequences, int64_t capacity) {
  // Sorted by expert and then token, so each (expert, sequence) group is contiguous.
  auto group = expert * sequences + token.div(seq_len, "floor");
  auto [unique, inverse, sizes] = torch::unique_consecutive(group, /*return_inverse=*/true, /*return_counts=*/true);
  auto starts = sizes.cumsum(0) - sizes;
  auto position = torch::arange(group.size(0), group.options()) - starts.index_select(0, inverse);
  return position < capacity;
}

// Group-limited routing: `choose` [tokens, experts] with the experts outside each token's `kept` best
// of `groups` contiguous groups set to -inf (as DeepSeek-V3's own code, torchtitan and transformers
// mask them); a group's score is the sum of its two best.
torch::Tensor within_best_groups(const torch::Tensor& choose, int64_t groups, int64_t kept) {
  const int64_t tokens = choose.size(0), n = choose.size(1);
  auto grouped = choose.view({tokens, groups, n / groups});
  auto group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);
  auto best = std::get<1>(group_scores.topk(kept, -1));
  auto out = torch::ones({tokens, groups}, choose.options().dtype(torch::kBool)).scatter(1, best, false);
  return grouped.masked_fill(out.unsqueeze(-1), -std::numeric_limits<double>::infinity()).view({tokens, n});
}

}  // namespace

MoE::MoE(int64_t dim, const MoeArgs& a) : Module("MoE"), args_(a) {
  router = add("router", std::make_shared<Linear>(dim, a.experts, false));
  experts = add("experts", std::make_shared<GroupedExperts>(a.experts, dim, a.hidden, a.grouped_mm));
  if (a.shared > 0) shared = add("shared", std::make_shared<FeedForward>(dim, a.hidden * a.shared));
  if (a.bias_update_rate > 0 || a.expert_bias) {
    expert_bias = register_buffer("expert_bias", torch::zeros({a.experts}, nn::buffer_options().dtype(torch::kFloat)));
  }
  step_counts.assign(a.experts, 0);
}

void MoE::update_bias(const torch::Tensor& counts) {
  if (!expert_bias.defined()) return;
  torch::NoGradGuard no_grad;
  auto c = counts.to(expert_bias.device(), torch::kFloat);
  expert_bias.add_(torch::sign(c.mean() - c) * args_.bias_update_rate);
}

MoE::Routing MoE::route(const torch::Tensor& flat) const {
  Routing r;
  r.logits = (*router)(flat).to(torch::kFloat);
  r.scores = args_.sigmoid ? torch::sigmoid(r.logits) : torch::softmax(r.logits, -1);
  auto choose = expert_bias.defined() ? r.scores + expert_bias.to(r.scores.device()) : r.scores;
  if (args_.n_group > 1) choose = within_best_groups(choose, args_.n_group, args_.topk_group);
  r.ids = std::get<1>(choose.topk(args_.top_k, -1, /*largest=*/true, /*sorted=*/true));
  r.weights = r.scores.gather(-1, r.ids);
  if (args_.route_norm) r.weights = r.weights / (r.weights.sum(-1, /*keepdim=*/true) + 1e-20);
  if (args_.route_scale != 1.0) r.weights = r.weights * args_.route_scale;
  return r;
}

torch::Tensor MoE::with_router_losses(torch::Tensor out, const torch::Tensor& x, const Routing& r) const {
  if (x.dim() != 3 || !torch::GradMode::is_enabled()) return out;
  const int64_t b = x.size(0), seq = x.size(1), k = args_.top_k, n = args_.experts;
  if (args_.aux_loss_coeff > 0) {
    auto p = args_.sigmoid ? r.scores / r.scores.sum(-1, /*keepdim=*/true) : r.scores;
    auto mean_score = p.view({b, seq, n}).mean(1);
    auto routed = torch::zeros({b, n}, r.scores.options())
                      .scatter_add_(1, r.ids.view({b, seq * k}), torch::ones({b, seq * k}, r.scores.options()))
                      .div_(static_cast<double>(seq * k));
    auto aux = (mean_score * routed).sum() * (static_cast<double>(n) * args_.aux_loss_coeff);
    out = AuxLossFn::apply(out, aux, aux_weight);
  }
  if (args_.z_loss_coeff > 0) {
    // logsumexp as ATen computes it for finite logits (its infinity guard has no meta kernel for the dry run).
    auto top = r.logits.amax(-1, /*keepdim=*/true);
    auto lse = (r.logits - top).exp().sum(-1).log() + top.squeeze(-1);
    auto z = lse.pow(2).sum() * (args_.z_loss_coeff / static_cast<double>(seq));
    out = AuxLossFn::apply(out, z, aux_weight);
  }
  return out;
}

torch::Tensor MoE::forward(torch::Tensor x) {
  const int64_t dim = x.size(-1), k = args_.top_k, n = args_.experts;
  auto flat = x.reshape({-1, dim});
  const Routing routing = route(flat);

  // Every (token, choice) row, sorted stably by expert: expert-major, tokens
  // in order within an expert.
  auto choice = routing.ids.reshape({-1});
  auto [sorted_expert, order] = choice.sort(/*stable=*/true, 0, /*descending=*/false);
  auto token = order.div(k, "floor");
  const bool meta = choice.is_meta();
  auto count = [n, meta](const torch::Tensor& expert) {
    std::vector<int64_t> out(n, expert.numel() / n);
    if (meta) {  // a dry run has no routing: it sizes for uniform routing
      for (int64_t e = 0; e < expert.numel() % n; ++e) ++out[e];
    } else {
      auto c = torch::bincount(expert, {}, n).to(torch::kCPU);
      out.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n);
    }
    return out;
  };
  std::vector<int64_t> counts = count(choice);
  last_counts = counts;
  const bool training = torch::GradMode::is_enabled() && !meta;
  if (training) {
    for (int64_t e = 0; e < n; ++e) step_counts[e] += counts[e];
  }
  if (args_.capacity_factor > 0 && x.dim() == 3 && !meta) {
    const int64_t seq = x.size(1);
    const auto capacity = static_cast<int64_t>(std::ceil(args_.capacity_factor * static_cast<double>(seq * k) /
                                                         static_cast<double>(n)));
    auto keep = within_capacity(sorted_expert, token, seq, x.size(0), capacity);
    auto kept = keep.nonzero().view(-1);
    if (training) step_dropped += order.numel() - kept.numel();
    order = order.index_select(0, kept);
    token = token.index_select(0, kept);
    counts = count(sorted_expert.index_select(0, kept));
  }
  auto rows = flat.index_select(0, token);
  auto out_rows = dispatch ? dispatch(rows, counts) : experts->run(rows, counts);
  auto row_weights = routing.weights.reshape({-1}).index_select(0, order).unsqueeze(1);
  auto weighted = (out_rows.to(torch::kFloat) * row_weights).to(x.scalar_type());
  auto out = torch::zeros_like(flat).index_add(0, token, weighted);
  if (shared) out = out + (*shared)(flat);
  return with_router_losses(out, x, routing).view(x.sizes());
}

std::vector<MoE*> moe_blocks(nn::Module& root) {
  std::vector<MoE*> out;
  for (const auto& m : root.modules(/*include_self=*/false)) {
    if (auto* moe = dynamic_cast<MoE*>(m.get())) out.push_back(moe);
  }
  return out;
}

}  // namespace composer::models

#include "models/moe.h"

#include <cmath>

namespace composer::models {

using nn::Linear;

FeedForward::FeedForward(int64_t dim, int64_t hidden) : Module("FeedForward") {
  w1 = add("w1", std::make_shared<Linear>(dim, hidden, false));
  w2 = add("w2", std::make_shared<Linear>(hidden, dim, false));
  w3 = add("w3", std::make_shared<Linear>(dim, hidden, false));
}

torch::Tensor FeedForward::forward(torch::Tensor x) { return (*w2)(torch::silu((*w1)(x)) * (*w3)(x)); }

GroupedExperts::GroupedExperts(int64_t experts, int64_t dim, int64_t hidden) : Module("GroupedExperts") {
  auto zero = [](torch::Tensor& w) { w.zero_(); };  // the block draws them (its depth-scaled init)
  w1 = register_parameter("w1", nn::new_param({experts, hidden, dim}, zero));
  w2 = register_parameter("w2", nn::new_param({experts, dim, hidden}, zero));
  w3 = register_parameter("w3", nn::new_param({experts, hidden, dim}, zero));
}

torch::Tensor GroupedExperts::run(const torch::Tensor& x, const std::vector<int64_t>& counts) {
  // One unbind per weight: backward stacks the experts' gradients once
  // (selecting each expert would make a zero-filled whole per expert).
  const auto a = param(w1).unbind(0), b = param(w2).unbind(0), c = param(w3).unbind(0);
  TORCH_CHECK(counts.size() == a.size(), "GroupedExperts: ", counts.size(), " counts for ", a.size(), " experts");
  std::vector<torch::Tensor> outs;
  int64_t at = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    if (counts[j] == 0) continue;
    auto rows = x.narrow(0, at, counts[j]);
    outs.push_back(torch::linear(torch::silu(torch::linear(rows, a[j])) * torch::linear(rows, c[j]), b[j]));
    at += counts[j];
  }
  TORCH_CHECK(at == x.size(0), "GroupedExperts: counts sum to ", at, " but ", x.size(0), " rows came");
  if (outs.empty()) return x.narrow(0, 0, 0) * 0;  // no rows: an empty output still joined to the graph
  return outs.size() == 1 ? outs[0] : torch::cat(outs, 0);
}

torch::Tensor GroupedExperts::forward(torch::Tensor x) { return run(x, {x.size(0)}); }

MoE::MoE(int64_t dim, const MoeArgs& a) : Module("MoE"), args_(a) {
  router = add("router", std::make_shared<Linear>(dim, a.experts, false));
  experts = add("experts", std::make_shared<GroupedExperts>(a.experts, dim, a.hidden));
  if (a.shared > 0) shared = add("shared", std::make_shared<FeedForward>(dim, a.hidden * a.shared));
}

torch::Tensor MoE::forward(torch::Tensor x) {
  const int64_t dim = x.size(-1), k = args_.top_k, n = args_.experts;
  auto flat = x.reshape({-1, dim});
  auto logits = (*router)(flat).to(torch::kFloat);
  auto scores = args_.sigmoid ? torch::sigmoid(logits) : torch::softmax(logits, -1);
  auto ids = std::get<1>(scores.topk(k, -1, /*largest=*/true, /*sorted=*/true));
  auto weights = scores.gather(-1, ids);
  if (args_.route_norm) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  if (args_.route_scale != 1.0) weights = weights * args_.route_scale;

  // Every (token, choice) row, sorted stably by expert: expert-major, tokens
  // in order within an expert.
  auto choice = ids.reshape({-1});
  auto order = std::get<1>(choice.sort(/*stable=*/true, 0, /*descending=*/false));
  auto token = order.div(k, "floor");
  std::vector<int64_t> counts(n, choice.numel() / n);
  if (choice.is_meta()) {  // a dry run has no routing: it sizes for uniform routing
    for (int64_t e = 0; e < choice.numel() % n; ++e) ++counts[e];
  } else {
    auto c = torch::bincount(choice, {}, n).to(torch::kCPU);
    counts.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n);
  }
  last_counts = counts;
  auto rows = flat.index_select(0, token);
  auto out_rows = dispatch ? dispatch(rows, counts) : experts->run(rows, counts);
  auto weighted = (out_rows.to(torch::kFloat) * weights.reshape({-1}).index_select(0, order).unsqueeze(1)).to(x.scalar_type());
  auto out = torch::zeros_like(flat).index_add(0, token, weighted);
  if (shared) out = out + (*shared)(flat);
  return out.view(x.sizes());
}

}  // namespace composer::models

#include "runner/train/experts.h"

#include <algorithm>

#include "models/moe.h"
#include "parallelisms/context_parallel.h"

namespace composer {

void bind_experts(models::Model& model, double aux_weight) {
  for (models::MoE* moe : models::moe_blocks(model)) moe->aux_weight = aux_weight;
}

ExpertStats finish_experts(models::Model& model, parallel::Parallel& par, bool update) {
  ExpertStats s;
  const auto blocks = models::moe_blocks(model);
  if (blocks.empty()) return s;
  s.any = true;
  const int64_t n = blocks.front()->args().experts;
  // One row per block: its experts' counts, then the rows it dropped.
  std::vector<double> local;
  for (models::MoE* moe : blocks) {
    for (int64_t c : moe->step_counts) local.push_back(static_cast<double>(c));
    local.push_back(static_cast<double>(moe->step_dropped));
    std::fill(moe->step_counts.begin(), moe->step_counts.end(), 0);
    moe->step_dropped = 0;
  }
  auto t = torch::tensor(local, torch::dtype(torch::kDouble).device(par.device))
               .view({static_cast<int64_t>(blocks.size()), n + 1});
  if (par.dp) parallel::all_reduce(*par.dp, t);
  if (par.cp) parallel::all_reduce(par.cp->group(), t);
  if (t.is_meta()) return s;  // a dry run: the reduction counted, no routing to report
  t = t.to(torch::kCPU);
  s.tokens.assign(n, 0);
  double routed = 0, dropped = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    auto counts = t[static_cast<int64_t>(b)].narrow(0, 0, n);
    if (update) blocks[b]->update_bias(counts);
    const double total = counts.sum().item<double>();
    if (total <= 0) continue;  // a block of another pipeline stage
    for (int64_t e = 0; e < n; ++e) s.tokens[e] += counts[e].item<double>();
    s.imbalance = std::max(s.imbalance, counts.max().item<double>() / (total / static_cast<double>(n)));
    routed += total;
    dropped += t[static_cast<int64_t>(b)][n].item<double>();
  }
  if (blocks.front()->args().capacity_factor > 0 && routed > 0) s.dropped = dropped / routed;
  return s;
}

}  // namespace composer

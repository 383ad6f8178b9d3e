// expert_parallel: the routed experts of every mixture-of-experts block
// (models/moe.h) split over the ep ranks, n_experts / ep each, a contiguous
// block per rank. The batch is split over ep like a data-parallel dim: each
// rank routes its own tokens, sends each (token, choice) row to the rank that
// holds its expert (an all-to-all of uneven sizes, the counts exchanged
// first), runs its experts on the rows it received and returns the outputs
// with the reverse all-to-all; the block then weighs and sums them as on one
// device. Placements: expert weights ep:S(0); their gradient on a rank is
// already the sum over every rank's tokens routed to it (the all-to-all's
// backward), so it is only averaged (divided by ep), never reduced; every
// other parameter is replicated over ep with its gradient averaged there.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "parallelisms/config_fields.h"

namespace composer::parallel {

// The `expert_parallel` transform's options (docs/configuration.md).
struct ExpertParallelConfig {
  static constexpr const char* kKey = "expert_parallel";
  static constexpr Splits kSplits = Splits::kBatch;
  static constexpr bool kMovesActivations = true;  // tokens go to their experts' ranks and back
  std::vector<std::string> mesh_dim{"ep"};

  template <class V>
  void fields(V& v) {
    v("mesh_dim", mesh_dim, kOneOrList);  // the one mesh dim whose ranks split the experts (and the batch)
  }
};

struct Applying;
struct Tracing;
// Splits the experts over the dim and installs the all-to-all dispatch.
bool apply(Applying& a, const ExpertParallelConfig& config);
// The dispatch changes no activation at a stage's edge.
void trace(Tracing& t, const ExpertParallelConfig& config);

}  // namespace composer::parallel

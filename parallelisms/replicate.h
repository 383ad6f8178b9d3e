// replicate (DDP): every data-parallel rank holds the whole model. The
// transform broadcasts rank 0's parameters over the data-parallel group and
// records that parameters are Replicate there with gradients Partial
// (averaged); the gradient synchronisation (grad_sync.h) turns that into
// bucketed all-reduces that start during backward as soon as a bucket's
// gradients are accumulated.
#pragma once
#include <torch/torch.h>

#include <functional>

#include "models/model.h"
#include "parallelisms/collectives.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

struct ReplicateOptions {
  // Only parameters it accepts are replicated (a pipeline rank's own stages);
  // nullptr replicates every parameter.
  std::function<bool(const torch::Tensor&)> param_filter;
};

// Broadcasts rank 0's parameters over `group` and records their placement.
void apply_replicate(models::Model& model, Group& group, const ReplicateOptions& options, Placements& placements);

}  // namespace composer::parallel

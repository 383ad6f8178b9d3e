// replicate (DDP): every data-parallel rank holds the whole model. The
// transform broadcasts rank 0's parameters over the data-parallel group and
// records that parameters are Replicate there with gradients Partial
// (averaged); the gradient synchronisation (grad_sync.h) turns that into
// bucketed all-reduces that start during backward as soon as a bucket's
// gradients are accumulated.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

struct ReplicateOptions {
  // Parameters (FQN patterns; a module's select its parameters) each rank
  // keeps its own (per_rank.h): neither broadcast nor reduced.
  std::vector<std::string> per_rank;
  double bucket_mb = 25;  // gradient bytes per all-reduce bucket (the gradient synchronisation's)
};

// Broadcasts rank 0's parameters over `group` and records their placement.
void apply_replicate(const std::vector<models::Root>& roots, Group& group, const ReplicateOptions& options,
                     Placements& placements);
void apply_replicate(models::Model& model, Group& group, const ReplicateOptions& options, Placements& placements);

}  // namespace composer::parallel

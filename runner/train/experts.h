// The trainer's side of mixture-of-experts blocks (models/moe.h): the weight
// their load-balancing loss joins backward with, and after each step the
// routing counts summed over every rank that routed tokens, the
// auxiliary-loss-free bias update and the step's figures.
#pragma once
#include <vector>

#include "models/model.h"
#include "parallelisms/parallel.h"

namespace composer {

// What one step's routing did, over every rank that routed tokens and the
// blocks this rank holds.
struct ExpertStats {
  bool any = false;             // the model has mixture-of-experts blocks
  std::vector<double> tokens;   // rows routed to each expert, summed over the blocks
  double imbalance = -1;        // the largest, over blocks, of max / mean rows per expert (-1: none routed)
  double dropped = -1;          // the fraction of rows dropped over capacity (-1: dropless)
};

// Every block's load-balancing loss weight: one sequence's share of the loss
// as backward sees it (loss.scale x the backward scale / global_batch).
void bind_experts(models::Model& model, double aux_weight);

// After a step's backward (every rank of the data-parallel and context-parallel
// groups calls it): sums the step's counts over them, moves each block's
// expert bias when `update` (not on a step the optimizer skipped), clears the
// counts and returns the figures.
ExpertStats finish_experts(models::Model& model, parallel::Parallel& par, bool update);

}  // namespace composer

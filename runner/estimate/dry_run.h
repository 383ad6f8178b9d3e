// A rank's training without values: the model built shape-only on the meta
// device, the plan applied on a mesh without process groups (whose
// collectives move nothing but count their bytes), and the same step code as
// a real run, with every meta tensor's bytes counted (memory::MetaCount).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/plan/planner.h"
#include "runner/train/data.h"
#include "runner/train/step.h"

namespace composer {

struct DryRun {
  std::vector<int64_t> step_peaks;  // the most tensor bytes alive at once in each step
  MemoryTerms terms;
  CommBytes comm;                   // of the last step
};

// A batch of `n` samples with the data plan's shapes, on the meta device.
using MetaBatch = std::function<Batch(const DataPlan&, int64_t n)>;

// Runs `steps` training steps of rank `r` on the meta device: what a real
// run's counters measure, predicted.
DryRun dry_run(const ExperimentConfig& c, const Plan& plan, int r, int64_t steps, const MetaBatch& meta_batch);

// Each parameter's global shape, placement per mesh dim and the reductions
// its gradient needs, as the transforms record them (one line each; a
// summary past `limit` lines). Builds the model once per pipeline stage and
// applies the plan on a mesh without process groups: no rank starts.
std::vector<std::string> describe_placements(const ExperimentConfig& c, const Plan& plan, size_t limit = 64);

}  // namespace composer

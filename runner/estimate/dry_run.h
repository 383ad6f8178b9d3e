// A rank's training without values: the model built shape-only on the meta
// device, the plan applied on a mesh without process groups (whose
// collectives move nothing but count their bytes), and the same step code as
// a real run, with every meta tensor's bytes counted (memory::MetaCount).
#pragma once
#include <functional>
#include <map>
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
  CommBytes comm;  // of the last step
  // Every parameter's placement on this rank, in the model's order (their groups left out): from
  // them, any rank's pieces (ShardSpec::box_at).
  std::vector<parallel::ShardSpec> specs;
  // Token files: the bytes of the rank's share of one global batch (inputs, targets, document
  // starts), which the loader reads a step ahead while a step runs.
  int64_t batch_bytes = 0;
};

// A batch of `n` samples with the data plan's shapes, on the meta device.
using MetaBatch = std::function<Batch(const DataPlan&, int64_t n)>;

// Runs `steps` training steps of rank `r` on the meta device: what a real
// run's counters measure, predicted.
DryRun dry_run(const ExperimentConfig& c, const Plan& plan, int r, int64_t steps, const MetaBatch& meta_batch);

// One parameter's placement as the transforms record it.
struct PlacementRow {
  std::string name;       // the parameter's FQN
  std::string shape;      // its global shape, "[16, 8]"
  std::string placement;  // per mesh dim, in the order the transforms applied: "tp:S(0) dp:S(0)/P(avg)"
  std::string gradient;   // the reductions its gradient needs: "reduce-scatter dp, all-reduce tp (sum)"
};

// Every parameter's row, in the model's order. Builds the model once per
// pipeline stage and applies the plan on a mesh without process groups: no
// rank starts.
std::vector<PlacementRow> describe_placements(const ExperimentConfig& c, const Plan& plan);

// optimizer muon: what making its matrices whole moves per step, in closed form over all ranks.
// A mesh dim of s ranks that splits a matrix (not a stack's expert dim) moves (s - 1) / s of it
// to that level's owners in the training dtype and as much back in ns_dtype, once per copy of the
// matrix's pieces (replicas gather on their own).
struct MuonTraffic {
  int64_t matrices = 0;     // parameters Muon trains (an expert stack counts once)
  int64_t values = 0;       // their elements
  int64_t whole_here = 0;   // of them, whole on every rank that holds them: nothing moves
  std::map<std::string, std::pair<int64_t, int64_t>> bytes;  // mesh dim: (to the owners, back)
};
MuonTraffic muon_traffic(const ExperimentConfig& c, const Plan& plan);

}  // namespace composer

// The training loop: builds the model, applies the plan's transforms, runs
// the configured steps over this rank's share of the data, records metrics
// and returns what a golden comparison needs.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/model.h"
#include "parallelisms/placement.h"
#include "runner/config.h"
#include "runner/data.h"
#include "runner/metrics.h"
#include "runner/planner.h"
#include "runner/rank.h"
#include "runner/safetensors.h"

namespace composer {

struct TrainResult {
  std::vector<StepRecord> steps;
};

// Builds the model of `c`: seeded init, then model.init_from when set.
models::ModelPtr build_model(const ExperimentConfig& c);

// The intra-op threads of each rank: train.threads, or the cores shared
// equally by the machine's local ranks.
int rank_threads(const TrainConfig& t, int64_t local_ranks);

// Trains per `plan` on this rank. The main rank writes config.resolved.json,
// init.safetensors, metrics.jsonl and final.safetensors (the full parameters,
// streamed to it from their owners) into `out_dir`. With
// `checkpoints`, it resumes per checkpoint.resume and saves per
// checkpoint.interval (composer run; check and golden always train afresh).
TrainResult train(const ExperimentConfig& c, const Plan& plan, RankContext& rank, const std::string& out_dir,
                  bool checkpoints = false);

// Each parameter's global shape, placement per mesh dim and the reductions
// its gradient needs, as the transforms record them (one line each; a
// summary past `limit` lines). Builds the model once per pipeline rank and
// applies the plan on a mesh without process groups: no rank starts.
std::vector<std::string> describe_placements(const ExperimentConfig& c, const Plan& plan, size_t limit = 64);

// A rank's memory by term after its first step (bytes): the parameter
// pieces it holds, their gradients, the optimizer state and the buffers the
// transforms keep for communication (fully_shard's pools, gradient buckets).
struct MemoryTerms {
  int64_t params = 0, grads = 0, optimizer = 0, buffers = 0;
};

// The bytes one step's collectives moved: per group ("dp", "tp", "pp", ...)
// and collective kind ("all_gather", "reduce_scatter", "all_reduce",
// "broadcast", "send", "recv").
using CommBytes = std::map<std::string, std::map<std::string, int64_t>>;

struct DryRun {
  std::vector<int64_t> step_peaks;  // the most tensor bytes alive at once in each step
  MemoryTerms terms;
  CommBytes comm;                   // of the last step
};

// A batch of `n` samples with the data plan's shapes, on the meta device.
using MetaBatch = std::function<Batch(const DataPlan&, int64_t n)>;

// Runs `steps` training steps of rank `r` on the meta device (shapes, no
// storage): the model built shape-only, the plan applied on a mesh without
// process groups, whose collectives move nothing but count their bytes, and
// the same step code as a real run, with every meta tensor's bytes counted
// (memory::MetaCount). What a real run's counters measure, predicted.
DryRun dry_run(const ExperimentConfig& c, const Plan& plan, int r, int64_t steps, const MetaBatch& meta_batch);

// The resolved config plus the decided data plan and the config hash: what
// the PyTorch reference reads to reproduce a run.
nlohmann::json resolved_json(const ExperimentConfig& c, const DataPlan& data);

}  // namespace composer

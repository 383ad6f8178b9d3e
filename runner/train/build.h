// Building a rank's model: the model from the config (seeded init, then
// model.init_from), the plan's transforms applied through parallel::parallelize
// in the order the YAML lists them, and values given only to what this rank
// holds. A real run and a dry run (runner/estimate) build the same way.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <set>
#include <string>

#include "models/model.h"
#include "parallelisms/parallelize.h"
#include "runner/config/config.h"
#include "runner/launch/rank.h"
#include "runner/plan/planner.h"
#include "runner/train/data.h"

namespace composer {

// Builds the model of `c`: seeded init, then model.init_from when set.
models::ModelPtr build_model(const ExperimentConfig& c);

// What a run opens before it trains, opened and checked without training
// (once per job before any rank starts, and by composer plan): the init_from
// file's header against the model, the data files, and with `resume` the
// checkpoint checkpoint.resume picks under `out_dir`. Throws the same exit-2
// errors training would.
void preflight(const ExperimentConfig& c, const std::string& out_dir, bool resume);

// The data plan (inputs, targets, seq_len, vocabulary) from a shape-only
// build of the model: names and shapes, no values, no random draws.
DataPlan shape_data_plan(const ExperimentConfig& c);

// Where the run's first `n` global samples come from (composer plan --samples):
// each one's step, index, source, path, window start and, with packed
// documents, how many documents its inputs meet. UserError for data drawn
// from the seed.
nlohmann::json preview_samples(const ExperimentConfig& c, int64_t n);

// The intra-op threads of each rank: train.threads, or the cores shared
// equally by the machine's local ranks.
int rank_threads(const TrainConfig& t, int64_t local_ranks);

// The parameters train.freeze and train.lora keep fixed (lora: every one but
// the adapters), by name; a ConfigError naming train.freeze for a pattern
// that names nothing, or patterns that freeze everything.
std::set<std::string> frozen_names(models::Model& model, const TrainConfig& t);

// Applies the plan to `model` on `rank` (parallel::parallelize): the
// transforms bind their groups on the rank's mesh. `microbatch` gives one
// microbatch of inputs for a transform that traces activation shapes (unset:
// shapes are not needed); the main rank logs one line per transform.
parallel::Parallel apply_plan(models::Model& model, const ExperimentConfig& c, const Plan& plan, RankContext& rank,
                              std::function<torch::Tensor()> microbatch);

// One rank's model with the plan applied and its values in place.
struct RankModel {
  models::ModelPtr model;
  parallel::Parallel par;
  DataPlan data;
  std::unique_ptr<DataSet> dataset;
  std::unique_ptr<DataSet> eval_dataset;  // eval's held-out data (the training data's plan); null without eval
};

// The initial weights a golden was trained from (`composer check` of a golden
// that carries them, runner/verify/golden.h): the run draws its own as usual,
// the main rank measures how far each drawn tensor is from the golden's, and
// every rank trains from the golden's. Another CPU's random-fill kernels round
// differently (a few ulps); a changed initialisation moves whole tensors.
struct GoldenStart {
  std::string path;  // the golden's init file
  // Filled on the main rank: the largest |drawn - golden| over the golden
  // tensor's largest magnitude, and where it is.
  double worst = 0;
  std::string worst_name;
  int64_t worst_index = 0;
  double worst_drawn = 0, worst_golden = 0;
};

// Builds this rank's model for training: a plan that shards or splits the
// model builds it on meta and gives values only to what the rank holds (equal
// to a single-device build's); the main rank writes config.resolved.json and
// init.safetensors into `out_dir` ("": nothing is written).
// With `start`, its weights replace the drawn ones (GoldenStart).
RankModel build_rank_model(const ExperimentConfig& c, const Plan& plan, RankContext& rank, const std::string& out_dir,
                           GoldenStart* start = nullptr);

// The resolved config plus the decided data plan and the config hash: what
// the PyTorch reference reads to reproduce a run.
nlohmann::json resolved_json(const ExperimentConfig& c, const DataPlan& data);

// Writes `j` to `path` (indented), creating its folder; a RuntimeFailure when it cannot.
void write_json(const std::string& path, const nlohmann::json& j);

}  // namespace composer

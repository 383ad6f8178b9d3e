// The training loop: builds the model, applies the plan's transforms, runs
// the configured steps over this rank's share of the data, records metrics
// and returns what a golden comparison needs.
#pragma once
#include <functional>
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

// Builds the model of `c` shape-only (meta tensors), applies the plan for
// rank `r` on a mesh without process groups and calls `visit` with the model
// and the placements the transforms recorded.
void with_planned_model(const ExperimentConfig& c, const Plan& plan, int r,
                        const std::function<void(models::Model&, const parallel::Placements&)>& visit);

// The resolved config plus the decided data plan and the config hash: what
// the PyTorch reference reads to reproduce a run.
nlohmann::json resolved_json(const ExperimentConfig& c, const DataPlan& data);

}  // namespace composer

// The training run of one rank: builds its model with the plan applied
// (build.h), runs the configured steps over its share of the data, records
// metrics, saves checkpoints and writes the reports a golden comparison and
// the estimate checks read.
#pragma once
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/launch/rank.h"
#include "runner/plan/planner.h"
#include "runner/observe/metrics.h"
#include "runner/train/record.h"

namespace composer {

struct GoldenStart;  // build.h

struct TrainResult {
  std::vector<StepRecord> steps;
};

// Trains per `plan` on this rank. The main rank writes config.resolved.json,
// init.safetensors, metrics.jsonl and final.safetensors (the full parameters,
// streamed to it from their owners) into `out_dir`. With
// `checkpoints`, it resumes per checkpoint.resume and saves per
// checkpoint.interval (composer run; check and golden always train afresh).
// With `record.step` (composer diff), the rank records that step's tensors
// (record.h) into record.dir and stops after it. With `start` (composer check
// of a golden that carries its initial weights) it trains from those
// (GoldenStart, build.h).
TrainResult train(const ExperimentConfig& c, const Plan& plan, RankContext& rank, const std::string& out_dir,
                  bool checkpoints = false, const RecordOptions& record = {}, GoldenStart* start = nullptr);

}  // namespace composer

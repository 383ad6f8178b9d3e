// pipeline: splits a model's pipeline pieces into stages (split_points or
// layers_per_stage), places them on the pp ranks (loop or V placement), and
// runs a schedule's action lists with send/recv over the pp group. Stage input
// shapes are inferred by running the pieces on one example microbatch. Each
// stage's graph is separate: a stage's input is a leaf whose gradient is sent
// back (or handed to the previous stage when it lives on the same rank).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/model.h"
#include "parallelisms/collectives.h"
#include "parallelisms/placement.h"
#include "parallelisms/schedule.h"

namespace composer::parallel {

struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::k1f1b;
  int virtual_stages = 1;
  int microbatches = 1;
  std::vector<std::string> split_points;  // piece names where stages 1.. start
  int64_t layers_per_stage = 0;           // 0: split the layers evenly
  // Where every parameter's pp placement is recorded: Replicate on the pp
  // ranks whose stages hold it (its members), gradients Partial (summed over
  // the members: a tied weight on two stages).
  Placements* placements = nullptr;
  // The group over some pp ranks (for a parameter several stages hold).
  std::function<Group*(const std::vector<int>& members)> subgroup;
};

// [begin, end) piece ranges of every stage, or the reason the split fails.
std::optional<std::string> split_stages(const std::vector<models::PipelinePiece>& pieces, int stages,
                                        const std::vector<std::string>& split_points, int64_t layers_per_stage,
                                        std::vector<std::pair<size_t, size_t>>& ranges);

struct TimelineEntry {
  std::string action;  // "F3.1", "B0.2", ...
  double start_ms = 0;
  double end_ms = 0;
};

class Pipeline {
 public:
  // `example` is one microbatch of inputs, for shape inference.
  Pipeline(models::Model& model, Group& pp, const PipelineOptions& options, const torch::Tensor& example);

  const PipelineShape& shape() const { return shape_; }
  Group& group() { return group_; }
  ScheduleKind kind() const { return options_.schedule; }
  // Runs one step's actions. `input_of(mb)` gives a microbatch's inputs (read
  // on the first stage's rank), `loss_of(mb, output)` its loss on the last
  // stage's rank; backward runs on loss x `loss_factor`. Returns the sum of
  // the microbatch losses (before the factor) on the last stage's rank, 0 elsewhere.
  double run(const std::function<torch::Tensor(int)>& input_of,
             const std::function<torch::Tensor(int, const torch::Tensor&)>& loss_of, double loss_factor);
  // Whether this rank computes with `p` (one of its stages holds it).
  bool holds(const torch::Tensor& p) const;
  // Whether one of this rank's stages computes with the module `fqn`.
  bool runs(const std::string& fqn) const;
  // This rank's timeline of the last run (compute actions, ms since its start).
  const std::vector<TimelineEntry>& timeline() const { return timeline_; }
  // The last run's loss of each microbatch (before the factor) on the last
  // stage's rank, zeros elsewhere.
  const std::vector<double>& microbatch_losses() const { return losses_; }
  std::vector<int> local_stages() const { return shape_.stages_of(group_.rank); }

 private:
  struct Slot;  // per (stage, microbatch) state
  torch::Tensor stage_forward(int stage, torch::Tensor x);
  int tag(Op op, int stage, int mb) const;

  models::Model& model_;
  Group& group_;
  PipelineOptions options_;
  PipelineShape shape_;
  // The schedule splits backward into I and W: stage forwards defer the
  // Linear weight gradients (nn::DeferWeightGrads) for the W actions.
  bool deferred_ = false;
  std::vector<models::PipelinePiece> pieces_;
  std::vector<std::pair<size_t, size_t>> ranges_;
  std::vector<std::string> local_modules_;                 // the modules this rank's stages run
  std::vector<RankActions> actions_;                 // with communication, every rank's
  std::vector<std::vector<int64_t>> input_shape_;    // per stage
  std::vector<c10::ScalarType> input_dtype_;
  c10::Device device_ = c10::kCPU;                   // the example's: meta in a dry run
  std::vector<std::vector<int64_t>> output_shape_;   // per stage
  struct ParamInfo {
    std::vector<int> ranks;  // pp ranks whose stages hold it, ascending
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
  };
  std::unordered_map<const c10::TensorImpl*, ParamInfo> params_;
  std::vector<TimelineEntry> timeline_;
  std::vector<double> losses_;
};

}  // namespace composer::parallel

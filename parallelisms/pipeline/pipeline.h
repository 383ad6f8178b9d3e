// pipeline: cuts a model's pipeline pieces into stages (split_points or
// layers_per_stage), places them on the pp ranks (loop or V placement), and
// runs a schedule's action lists with send/recv over the pp group. The cut
// comes first: each of this rank's stages becomes a root module (its forward
// runs the stage's pieces) that the other transforms then apply to, as
// PyTorch's pipelining and torchtitan do. Stage input and output shapes are
// traced on a shape-only copy of the model cut and transformed the same way
// (trace, set_shapes). Each stage's graph is separate: a stage's input is a
// leaf whose gradient is sent back (or handed to the previous stage when it
// lives on the same rank).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/pipeline/p2p_program.h"
#include "parallelisms/pipeline/schedule.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

// The `pipeline` transform's options (docs/configuration.md): the one mesh
// dim whose ranks hold the stages, the schedule and how the model is cut.
struct PipelineConfig {
  static constexpr const char* kKey = "pipeline";
  static constexpr Splits kSplits = Splits::kLayers;
  static constexpr bool kMovesActivations = true;  // a stage sends its outputs to the next
  std::vector<std::string> mesh_dim{"pp"};
  ScheduleKind schedule = ScheduleKind::k1f1b;
  int64_t microbatches = 0;  // the planner resolves 0 to the step's count
  int64_t virtual_stages = 1;
  std::vector<std::string> split_points;
  int64_t layers_per_stage = 0;
  bool scale_grads = true;
  // Resolved by the planner: the factor on each microbatch's loss that gives
  // scale_grads its meaning for the training loss (pipeline_loss_factor).
  double loss_factor = 1;

  template <class V>
  void fields(V& v) {
    v("mesh_dim", mesh_dim, kOneOrList);             // the one mesh dim whose ranks hold the stages
    v("schedule", schedule);                         // the schedule
    v("microbatches", microbatches, kNonNegative);   // per step; 0 = train.microbatches when > 1, else pp (V: 2 pp)
    v("virtual_stages", virtual_stages, kPositive);  // stages per rank (zbv, dualpipev: 2)
    v("split_points", split_points);                 // FQNs where a stage starts
    v("layers_per_stage", layers_per_stage, kNonNegative);  // 0 = split evenly
    v("scale_grads", scale_grads);                   // divide gradients by the microbatch count
  }
  // A V (zbv, dualpipev) needs two stages per rank: its default.
  std::optional<FieldError> check(const std::set<std::string>& given) {
    if (v_schedule(schedule) && !given.count("virtual_stages")) virtual_stages = 2;
    return std::nullopt;
  }
};

// The factor on each microbatch's loss (before backward) that gives PyTorch's
// scale_grads semantics over `microbatches`: its microbatch loss is the loss
// function over the microbatch (a mean-type loss is n x the microbatch's share
// of the batch loss), divided by n when scale_grads.
double pipeline_loss_factor(bool scale_grads, bool sum_loss, int64_t microbatches);

// A pipeline as a rank runs it: its config (microbatches resolved) and where it records placements.
struct PipelineOptions : PipelineConfig {
  // Where every parameter's pp placement is recorded: Replicate on the pp
  // ranks whose stages hold it (its members), gradients Partial (summed over
  // the members: a tied weight on two stages).
  Placements* placements = nullptr;
  // The group over some pp ranks (for a parameter several stages hold).
  std::function<Group*(const std::vector<int>& members)> subgroup;
  // Hold every stage, not only this rank's, and keep every parameter: a
  // shape-only copy of the model whose trace() gives the stage shapes.
  bool every_stage = false;
  // The order sends and receives are issued in; unset: the group's backend's
  // (p2p_order_for). Set, it runs NCCL's order over Gloo too.
  std::optional<P2POrder> p2p_order;
};

struct Applying;
// Cuts the model into this rank's stages (the roots every later transform
// applies to) and traces the stage shapes through the later transforms.
bool apply(Applying& a, const PipelineConfig& config);
struct Tracing;
void trace(Tracing& t, const PipelineConfig& config);

// Each stage's input shape and dtype and output shape, in stage order.
struct StageShapes {
  std::vector<std::vector<int64_t>> input;
  std::vector<c10::ScalarType> input_dtype;
  std::vector<std::vector<int64_t>> output;
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
  // Cuts `model`: this rank's stages become roots(); the parameters of the
  // other ranks' stages are dropped.
  Pipeline(models::Model& model, Group& pp, const PipelineOptions& options);
  ~Pipeline();

  // This rank's stages as roots, in stage order, for the other transforms.
  const std::vector<models::Root>& roots() const { return roots_; }
  // Runs one example microbatch through every stage in order (no grad) and
  // records the shapes (every_stage only).
  StageShapes trace(torch::Tensor example);
  // The stage shapes the schedule's receives allocate; run() needs them.
  void set_shapes(const StageShapes& shapes) { shapes_ = shapes; }

  const PipelineShape& shape() const { return shape_; }
  Group& group() { return group_; }
  ScheduleKind kind() const { return options_.schedule; }
  // Runs one step's actions. `input_of(mb)` gives a microbatch's inputs (read
  // on the first stage's rank), `loss_of(mb, output)` its loss on the last
  // stage's rank; backward runs on loss x the config's loss_factor x
  // `grad_scale`. Returns the sum of the microbatch losses (before either
  // factor) on the last stage's rank, 0 elsewhere.
  // `enter(mb)`, when given, runs before every compute action of microbatch
  // mb (its forward, backward or weight gradient): what the model reads per
  // microbatch besides its input (packed documents).
  double run(const std::function<torch::Tensor(int)>& input_of,
             const std::function<torch::Tensor(int, const torch::Tensor&)>& loss_of, double grad_scale,
             const std::function<void(int)>& enter = {});
  // Forward only (the caller holds a NoGradGuard), for evaluation: every
  // microbatch through every stage in order, activations sent to the next
  // stage's rank; `loss_of` on the last stage. Returns the sum of the
  // microbatch losses on the last stage's rank, 0 elsewhere. The last run()'s
  // timeline and microbatch losses are kept.
  double evaluate(const std::function<torch::Tensor(int)>& input_of,
                  const std::function<torch::Tensor(int, const torch::Tensor&)>& loss_of,
                  const std::function<void(int)>& enter = {});
  // Whether this rank computes with `p` (one of its stages holds it).
  bool holds(const torch::Tensor& p) const;
  // This rank's timeline of the last run (compute actions, ms since its start).
  const std::vector<TimelineEntry>& timeline() const { return timeline_; }
  // The last run's loss of each microbatch (before the factor) on the last
  // stage's rank, zeros elsewhere.
  const std::vector<double>& microbatch_losses() const { return losses_; }
  std::vector<int> local_stages() const { return shape_.stages_of(group_.rank); }

 private:
  // The constructor's stages: the cut into stages, the parameters' placements.
  void cut_stages(models::Model& model);
  void place_params(models::Model& model);
  struct Slot;  // per (stage, microbatch) state
  struct Run;   // one run()'s slots, sends and loss
  void act(const Action& a, Run& run);
  // Runs a program's steps; `what` names them in errors and trace spans.
  void execute(const P2PProgram& program, Run& run, const std::string& what, bool timed);
  // Issues a group of sends and receives; hands a waited group's receives to their slots.
  void issue(const P2PStep& step, Run& run);
  void deliver(int group, Run& run);
  void forward(int s, int mb, Run& run);
  std::pair<torch::Tensor, torch::Tensor> backward_root(Run& run, int s, int mb);
  torch::Tensor stage_forward(int stage, torch::Tensor x);
  bool local(int stage) const { return options_.every_stage || shape_.rank_of(stage) == group_.rank; }

  Group& group_;
  PipelineOptions options_;
  PipelineShape shape_;
  // The (stage, microbatch) pairs whose backward this rank splits into I and
  // W: their forwards defer the Linear weight gradients (nn::DeferWeightGrads)
  // for the W action; the others' B computes every gradient at once.
  std::set<std::pair<int, int>> deferred_;
  std::vector<models::PipelinePiece> pieces_;
  std::vector<std::pair<size_t, size_t>> ranges_;
  std::vector<std::shared_ptr<nn::Module>> stages_;  // per stage: the root module (null: another rank's)
  std::vector<models::Root> roots_;                  // this rank's stages
  std::vector<RankActions> actions_;                 // with communication, every rank's
  // This rank's training and evaluation steps: its actions with the sends
  // and receives grouped and ordered for the backend.
  P2PProgram program_, eval_program_;
  StageShapes shapes_;
  c10::Device device_ = c10::kCPU;                   // where receives allocate: meta in a dry run
  struct ParamInfo {
    std::vector<int> ranks;  // pp ranks whose stages hold it, ascending
    std::vector<int64_t> shape;
    c10::ScalarType dtype;
  };
  std::unordered_map<const c10::TensorImpl*, ParamInfo> params_;  // parameters and buffers
  std::vector<TimelineEntry> timeline_;
  std::vector<double> losses_;
};

}  // namespace composer::parallel

// One training step, shared by a real run (trainer.h) and a dry run
// (runner/estimate/dry_run.h): what a step reads, the step itself and what
// is measured around it.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <memory>
#include <vector>

#include "models/model.h"
#include "parallelisms/comm/delay.h"
#include "parallelisms/parallelize.h"
#include "runner/launch/rank.h"
#include "runner/plan/planner.h"
#include "runner/train/data.h"
#include "runner/observe/metrics.h"

namespace composer {

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


// What one training step reads: the rank's model and transforms, its
// parameters and optimizer, and where its batches come from.
struct StepState {
  const ExperimentConfig& c;
  const Plan& plan;
  models::Model& model;
  parallel::Parallel& par;
  std::vector<torch::Tensor>& params;
  torch::optim::Optimizer& optimizer;
  std::function<Batch(int64_t step, int64_t begin, int64_t end)> batch;
  int64_t batch_begin = 0;
  std::function<double()> data_wait_ms;  // the time the step waited for its batches (the loader's)
  double grad_scale = 1.0;
  const parallel::Delays& delays;
  int64_t skipped_in_a_row = 0;  // steps whose update train.on_nonfinite: skip left out, up to the last
  // composer diff's recorder (empty otherwise): the microbatch each forward
  // and backward action belongs to, and the gradients once synchronised.
  std::function<void(int64_t)> on_microbatch;
  std::function<void()> after_grad_sync;
};

// Zeroes every group's collective counters (a step's start).
void reset_counters(RankContext& rank);

// The step's collective calls and bytes, over every group, into `r`.
void add_comm(RankContext& rank, StepRecord& r);

// The bytes each group's collectives moved since the counters' reset, by kind.
CommBytes comm_bytes(RankContext& rank);

// The terms after a rank's first step, which went from `before` live bytes to
// `after`: what it holds then is its gradients, the optimizer state the step
// made and the buffers the transforms pooled (`buffers_before` of them before it).
MemoryTerms memory_terms(const parallel::Parallel& par, const std::vector<torch::Tensor>& params, int64_t buffers_before,
                         int64_t before, int64_t after);

// One step (r.step and r.lr set): every microbatch's forward and backward (or
// the pipeline schedule), the gradient synchronisation, the loss, the
// gradient norm and the optimizer step. A dry run runs it on meta tensors.
void run_step(StepState& s, StepRecord& r);

// The mean loss of `batches` global batches of held-out data (`batch` gives
// this rank's samples of eval batch 1, 2, ...), computed without gradients
// under the plan: each rank's part of every batch as in training (its data-
// parallel share, its microbatches, a pipeline forward only, its sequence
// slice), the shares summed over the ranks. The model is in eval mode for it
// and returns to training mode; parameters, gradients and the optimizer are
// untouched.
double evaluate(StepState& s, const std::function<Batch(int64_t step, int64_t begin, int64_t end)>& batch,
                int64_t batches);

// composer score: this rank's part of `b` (a batch of plan.local_batch rows:
// its microbatches, its sequence slice) forward only, as evaluate() runs it,
// and each target's -log p(target | the tokens before it) where this rank
// computes the logits (every rank of the tp group that holds them; a
// pipeline's last stage). `positions` gives each token's index in its row,
// shaped as b.inputs (cut as the inputs are). Returns rows [row of b, position,
// -log p] (float64, on the CPU) for the targets that are not -100.
torch::Tensor score_tokens(models::Model& model, parallel::Parallel& par, int64_t microbatch, const Batch& b,
                           const torch::Tensor& positions);

}  // namespace composer

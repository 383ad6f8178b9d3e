// One training step, shared by a real run and a dry run (trainer.h): the
// transforms a rank applied, what a step reads, and the step itself.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "models/model.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/delay.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/pipeline.h"
#include "parallelisms/tensor_parallel.h"
#include "runner/trainer.h"

namespace composer {

// The transforms applied to this rank's model, in the plan's order, the
// placements they recorded and the gradient synchronisation derived from them.
struct Parallel {
  bool any = false;               // a mesh with transforms (else plain single-device training)
  parallel::Group* dp = nullptr;  // every data-parallel rank (all replicate and shard dims flattened)
  parallel::Group* world = nullptr;
  std::unique_ptr<parallel::Placements> placements = std::make_unique<parallel::Placements>();
  std::unique_ptr<parallel::TensorParallel> tp;
  std::unique_ptr<parallel::ActivationCheckpoint> ac;
  std::unique_ptr<parallel::FullyShard> fsdp;
  std::unique_ptr<parallel::Pipeline> pipe;
  std::unique_ptr<parallel::GradSync> sync;
  c10::Device device = c10::kCPU;  // where small step tensors go: meta in a dry run
  parallel::ParamSet per_rank;    // parameters each data-parallel rank keeps its own
};

// What one training step reads: the rank's model and transforms, its
// parameters and optimizer, and where its batches come from.
struct StepState {
  const ExperimentConfig& c;
  const Plan& plan;
  models::Model& model;
  Parallel& par;
  std::vector<torch::Tensor>& params;
  torch::optim::Optimizer& optimizer;
  std::function<Batch(int64_t step, int64_t begin, int64_t end)> batch;
  int64_t batch_begin = 0;
  double grad_scale = 1.0;
  const parallel::Delays& delays;
};

// Zeroes every group's collective counters (a step's start).
void reset_counters(RankContext& rank);

// The step's collective calls and bytes, over every group, into `r`.
void add_comm(RankContext& rank, StepRecord& r);

// The bytes each group's collectives moved since the counters' reset, by kind.
CommBytes comm_bytes(RankContext& rank);

// Buffers the transforms keep for communication: fully_shard's pools and the
// gradient synchronisation's buckets.
int64_t buffer_bytes(const Parallel& par);

// The terms after a rank's first step, which went from `before` live bytes to
// `after`: what it holds then is its gradients, the optimizer state the step
// made and the buffers the transforms pooled (`buffers_before` of them before it).
MemoryTerms memory_terms(const Parallel& par, const std::vector<torch::Tensor>& params, int64_t buffers_before,
                         int64_t before, int64_t after);

// One step (r.step and r.lr set): every microbatch's forward and backward (or
// the pipeline schedule), the gradient synchronisation, the loss, the
// gradient norm and the optimizer step. A dry run runs it on meta tensors.
void run_step(StepState& s, StepRecord& r);

}  // namespace composer

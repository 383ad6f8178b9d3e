// parallelize: the one entry point from a training program into the
// transforms. It applies them to a model in the order they are listed, which
// is the order the user wrote:
//   pipeline (first, when present) cuts the model into this rank's stages,
//     and every later transform applies to each stage as a root;
//   tensor_parallel shards the math of the roots' modules;
//   context_parallel splits every sequence over its ranks (the model's
//     attention then moves keys and values between them);
//   activation_checkpointing wraps units, whose recompute re-runs the
//     tensor-parallel collectives inside them;
//   fully_shard or replicate shards or replicates what the rank holds; their
//     hooks run around the checkpointed forward, so a unit is gathered before it.
// Each transform records what it does in the placements; the gradient
// synchronisation is then derived from them, in one place (grad_sync.h), once
// the parameters have their values (Parallel::derive_grad_sync).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "models/tp_plan.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/context_parallel.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/pipeline/pipeline.h"
#include "parallelisms/placement.h"
#include "parallelisms/replicate.h"
#include "parallelisms/tensor_parallel.h"

namespace composer::parallel {

// One transform to apply: the groups it spans and its own options.
struct PipelineStep {
  Group* group = nullptr;  // the pp dim
  PipelineOptions options;
};
struct TensorParallelStep {
  Group* group = nullptr;  // the tp dim
  models::TpPlan plan;
  std::string loss_parallel;  // the module whose logits stay vocabulary-sharded ("": none)
};
struct ContextParallelStep {
  Group* group = nullptr;  // the cp dim
  ContextParallelOptions options;
};
struct ActivationCheckpointingStep {
  ActivationCheckpointOptions options;
};
struct FullyShardStep {
  Group* group = nullptr;          // the dim it shards over (HSDP: the second of its two)
  Group* data_parallel = nullptr;  // every dim it spans: per-rank parameters differ over it
  FullyShardOptions options;
  bool shard_opposite = false;  // shard each parameter on the dim an earlier Shard placement does not
};
struct ReplicateStep {
  Group* group = nullptr;  // every dim it spans
  ReplicateOptions options;
};
using Transform = std::variant<PipelineStep, TensorParallelStep, ContextParallelStep, ActivationCheckpointingStep,
                               FullyShardStep, ReplicateStep>;

// "fully_shard", "pipeline", ...
const char* name_of(const Transform& t);

// std::visit over a Transform (or a transform's config) with one lambda per alternative.
template <class... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

struct ParallelizeOptions {
  Group* world = nullptr;          // every rank: the gradient norm
  Group* data_parallel = nullptr;  // every data-parallel dim: the loss
  // One pipeline microbatch of inputs, for the stage shapes (undefined: no
  // shapes, as when only placements are wanted), and a shape-only copy of the
  // model built as `model` was, which the pipeline traces them on.
  torch::Tensor example;
  std::function<models::ModelPtr()> shape_copy;
  std::function<void(const std::string&)> log;  // one line per transform applied
};

// The transforms applied to one rank's model, the placements they recorded
// and the gradient synchronisation derived from them: what a training step
// calls, without knowing which transforms there are.
struct Parallel {
  bool any = false;     // a transform that spreads the model over ranks (else single-device training)
  Group* dp = nullptr;  // every data-parallel rank (all replicate and shard dims flattened)
  Group* world = nullptr;
  std::unique_ptr<Placements> placements = std::make_unique<Placements>();
  std::vector<models::Root> roots;  // what the transforms applied to: the model, or this rank's stages
  std::unique_ptr<Pipeline> pipe;
  std::unique_ptr<TensorParallel> tp;
  std::shared_ptr<ContextParallel> cp;
  std::unique_ptr<ActivationCheckpoint> ac;
  std::unique_ptr<FullyShard> fsdp;
  std::unique_ptr<GradSync> sync;
  ParamSet per_rank;                               // parameters each data-parallel rank keeps its own
  c10::Device device = c10::kCPU;                  // where small step tensors go: meta in a dry run
  double bucket_mb = GradSyncOptions{}.bucket_mb;  // replicate's, when it is applied
  VocabParallel vocab;  // loss parallel, on the rank that computes the logits: the loss is vocab_parallel_cross_entropy

  // The gradient synchronisation every reduction the placements call for
  // needs; its buckets live where the parameters do, so call it after they
  // have their values (a model materialised from meta).
  void derive_grad_sync();

  // This rank's part of a batch tensor whose dim 1 is the sequence (token
  // ids, per-token targets): its context-parallel slice, or all of it.
  torch::Tensor sequence_slice(const torch::Tensor& t) const { return cp ? cp->slice(t, 1) : t; }
  // The parameters this rank trains: the roots', each once.
  std::vector<torch::Tensor> held_params() const;
  // Off for the microbatches before the last: backward only accumulates.
  void set_requires_sync(bool sync);
  // After a backward: drops what fully_shard gathered.
  void reshard();
  // After the step's last backward: every reduction still pending, then the
  // synchronised gradients in place.
  void finish_grad_sync();
  // Buffers kept for communication: fully_shard's pools and the buckets.
  int64_t buffer_bytes() const;
};

// Applies `transforms` to `model` in order (see the top of this file).
Parallel parallelize(models::Model& model, const std::vector<Transform>& transforms, const ParallelizeOptions& options);

}  // namespace composer::parallel

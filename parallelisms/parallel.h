// What parallelize (parallelize.h) builds, and what each transform's apply()
// and trace() receive. A transform's own file defines, for its Config,
//   bool apply(Applying&, const XConfig&);  // returns whether it spreads the model over ranks
//   void trace(Tracing&, const XConfig&);   // what it does to a pipeline stage's edge shapes
// so a transform is written in one place, and one missing either of them
// does not build.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/comm/mesh.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

class Pipeline;
class TensorParallel;
class ContextParallel;
class ActivationCheckpoint;
class FullyShard;

// Loss parallel: the logits stay sharded over the vocabulary (torch.chunk
// pieces of `vocab` over the tp group); the loss is vocab_parallel_cross_entropy.
struct VocabParallel {
  Group* group = nullptr;  // the tp dim (nullptr: the logits are whole)
  int64_t vocab = 0;       // the full vocabulary
};

// The transforms applied to one rank's model, the placements they recorded
// and the gradient synchronisation derived from them: what a training step
// calls, without knowing which transforms there are.
struct Parallel {
  Parallel();
  Parallel(Parallel&&) noexcept;
  Parallel& operator=(Parallel&&) noexcept;
  ~Parallel();

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
  VocabParallel vocab;  // loss parallel, on the rank that computes the logits
  // Gradients scaled once a step, after every reduction: expert parallelism's
  // experts, whose gradient the all-to-all already summed over ep, by 1/ep.
  std::vector<std::pair<torch::Tensor, double>> grad_factors;

  // The gradient synchronisation every reduction the placements call for
  // needs; its buckets live where the parameters do, so call it after they
  // have their values (a model materialised from meta).
  void derive_grad_sync();

  // This rank's part of a batch tensor whose dim 1 is the sequence (token
  // ids, per-token targets): its context-parallel slice, or all of it.
  torch::Tensor sequence_slice(const torch::Tensor& t) const;
  // The parameters this rank trains: the roots', each once.
  std::vector<torch::Tensor> held_params() const;
  // Off for the microbatches before the last: backward only accumulates.
  void set_requires_sync(bool sync);
  // After a backward: drops what fully_shard gathered.
  void reshard();
  // After the step's last backward: every reduction still pending, then the
  // synchronised gradients in place, then grad_factors.
  void finish_grad_sync();
  // Buffers kept for communication: fully_shard's pools and the buckets.
  int64_t buffer_bytes() const;
  // A data-parallel transform over `spanned`, which may include the
  // context-parallel dim (FSDP sharding over the ranks that split the
  // sequence, as torchtitan's dp_shard_cp): its placement there, whose
  // gradient is averaged over cp too, takes the place of context
  // parallelism's Replicate / Partial(avg).
  void take_over_cp(const Group& spanned);
};

struct Tracing;

// What parallelize gives each transform's apply().
struct ParallelizeOptions {
  DeviceMesh* mesh = nullptr;      // the groups, bound by mesh-dim name (nullptr: no transform)
  Group* world = nullptr;          // every rank: the gradient norm
  Group* data_parallel = nullptr;  // every data-parallel dim: the loss
  c10::Device device = c10::kCPU;  // where the rank trains
  // For a transform that traces activation shapes (the pipeline, its stage
  // edges): one microbatch of inputs and a shape-only copy of the model built
  // as the model was, made when asked for. Unset: no shapes, as when only
  // placements are wanted.
  std::function<torch::Tensor()> microbatch;
  std::function<models::ModelPtr()> shape_twin;
  std::function<void(const std::string&)> log;  // one line per transform applied
};

// One transform being applied: the model, what the earlier transforms left,
// and the later ones' trace() (the pipeline traces its stage shapes through
// them).
struct Applying {
  models::Model& model;
  Parallel& par;
  const ParallelizeOptions& o;
  std::function<void(Tracing&)> trace_later;
  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }
  // The group over `dims` ("a+b" entries flattened).
  Group& group(const std::vector<std::string>& dims) const;
};

// A pipeline's stage shapes being traced: a shape-only copy of the model cut
// into every stage (`roots`), and one microbatch of inputs as stage 0 sees
// it. A later transform that changes an activation at a stage's edge applies
// itself to the roots or the input (recording its placements in `scratch`,
// keeping what must outlive the trace in `keep`).
struct Tracing {
  std::vector<models::Root> roots;
  torch::Tensor input;
  const ParallelizeOptions& o;
  Placements scratch;
  std::vector<std::shared_ptr<void>> keep;
  Group& group(const std::vector<std::string>& dims) const;
};

// "over dp (2 ranks)": the phrase of a transform's log line.
std::string over(const Group* g);

}  // namespace composer::parallel

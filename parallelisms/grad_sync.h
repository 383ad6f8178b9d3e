// Gradient synchronisation derived from placements, in one place. A
// gradient that backward leaves Partial on a mesh dim must be combined there:
// where the parameter is Shard on that dim, its owner (fully_shard's unit)
// reduce-scatters the unsharded gradient; everywhere else it is all-reduced
// (averaged over data-parallel dims, summed over tensor-parallel dims and over
// the pipeline ranks that hold a tied parameter). The all-reduces are bucketed
// by their list of reductions and launched during the last microbatch's
// backward as soon as a bucket's gradients are final; whatever is still
// pending (gradient accumulation, pipelines) goes after the last microbatch.
// A parameter whose gradient is undefined on every rank keeps no gradient, as
// in PyTorch, so the optimizer skips it.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "parallelisms/placement.h"

namespace composer::parallel {

// One all-reduce a gradient needs.
struct Reduction {
  Group* group = nullptr;
  Reduce op = Reduce::kSum;
  std::string dim;
  bool operator==(const Reduction& o) const { return group == o.group && op == o.op; }
};

// What a gradient needs after backward, read from its spec: the all-reduces
// (in spec order), and the dims whose reduce-scatter its owner runs.
struct GradPlan {
  std::vector<Reduction> all_reduces;
  std::vector<std::string> reduce_scatters;
  std::string str() const;  // "reduce-scatter dp, all-reduce tp (sum)"
};
GradPlan grad_plan(const ShardSpec& spec);

struct GradSyncOptions {
  double bucket_mb = 25;  // gradient bytes per all-reduce bucket
};

class GradSync {
 public:
  // `params`: this rank's parameters (the ones it holds), in registration order.
  GradSync(std::vector<torch::Tensor> params, const Placements& placements, const GradSyncOptions& options);
  ~GradSync();

  // Off for the microbatches before the last: backward only accumulates.
  void set_requires_sync(bool sync) { sync_ = sync; }
  // Launches every bucket not launched yet, waits for all and writes the
  // synchronised gradients back. Call after the last microbatch's backward
  // (and after fully_shard's deferred reduce-scatters).
  void finish();
  size_t num_buckets() const { return buckets_.size(); }
  int64_t buffer_bytes() const;  // the bucket buffers' (they live as long as this)

 private:
  struct Bucket {
    std::vector<Reduction> reductions;
    std::vector<size_t> params;  // indices into params_
    torch::Tensor buffer;        // every gradient flat, then one presence flag per parameter
    size_t ready = 0;
    Handle handle;
  };
  void on_ready(size_t k);
  void launch_in_order();
  void fill(Bucket& b, size_t k);

  std::vector<torch::Tensor> params_;
  std::vector<size_t> bucket_of_, offset_of_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  size_t next_launch_ = 0;
  bool sync_ = true;
};

}  // namespace composer::parallel

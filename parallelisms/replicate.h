// replicate (DDP): every data-parallel rank holds the whole model; gradients
// are averaged over the data-parallel group with bucketed all-reduces that
// start during backward as soon as a bucket's gradients are accumulated.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "models/model.h"
#include "parallelisms/collectives.h"

namespace composer::parallel {

struct ReplicateOptions {
  double bucket_mb = 25;  // gradient bytes per all-reduce bucket
  // Only parameters it accepts are replicated (a pipeline rank's own stages);
  // nullptr replicates every parameter.
  std::function<bool(const torch::Tensor&)> param_filter;
};

// Owns the gradient hooks of one replicated model.
class Replicate {
 public:
  Replicate(std::vector<torch::Tensor> params, Group& group, const ReplicateOptions& options);
  ~Replicate();

  // With false, backward only accumulates locally (gradient accumulation);
  // the microbatch whose backward should synchronise sets true first.
  void set_requires_sync(bool sync) { sync_ = sync; }
  // Waits for every bucket (launching any not launched yet with the current
  // gradients, zeros for parameters without one) and writes the averaged
  // gradients back. Call after backward.
  void finish();

  size_t num_buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    std::vector<size_t> params;  // indices into params_
    torch::Tensor buffer;        // flat, all the bucket's gradients
    size_t ready = 0;
    Handle handle;
    bool launched = false;
  };
  void on_ready(size_t param);
  void launch_in_order();

  std::vector<torch::Tensor> params_;
  std::vector<size_t> bucket_of_, offset_of_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // kept alive, as DDP does
  Group& group_;
  size_t next_launch_ = 0;
  bool sync_ = true;
};

// Broadcasts rank 0's parameters over `group` and installs the gradient hooks.
std::unique_ptr<Replicate> apply_replicate(models::Model& model, Group& group, const ReplicateOptions& options);

}  // namespace composer::parallel

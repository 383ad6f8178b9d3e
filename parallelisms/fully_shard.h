// fully_shard (FSDP2 semantics): every parameter is sharded on dim 0 over the
// data-parallel group (torch.chunk pieces, ranks with empty pieces allowed).
// Modules matching `units` are sharding units, each with one all-gather of
// all its parameters before its forward and one reduce-scatter (averaged) of
// their gradients in backward; the root is the last unit and owns every
// parameter no other unit owns. With reshard_after_forward the unsharded
// storage is freed after the unit's forward and gathered again just before
// its backward. The optimizer sees only the local shards.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/model.h"
#include "parallelisms/collectives.h"

namespace composer::parallel {

struct FullyShardOptions {
  std::vector<std::string> units;     // module FQN patterns; each match is its own unit
  bool reshard_after_forward = true;  // free unsharded parameters between forward and backward
};

// The unit FQNs that `units` selects in `model` (outermost first, root last as
// ""), or an error naming a pattern that matches nothing.
std::optional<std::string> check_units(models::Model& model, const std::vector<std::string>& units);

class FullyShard {
 public:
  struct Param;
  struct Unit;
  FullyShard(models::Model& model, Group& group, const FullyShardOptions& options);
  ~FullyShard();

  Group& group() { return group_; }
  size_t num_units() const;
  // With false, backward holds the unit gradients back (gradient
  // accumulation); the microbatch that should reduce-scatter sets true first.
  void set_requires_sync(bool sync) { sync_ = sync; }
  // Drops the unsharded parameters (after backward; the next forward gathers
  // the updated shards again).
  void reshard();
  // Whether `p` is one of the sharded parameters.
  bool is_sharded(const torch::Tensor& p) const;
  // The unsharded value of `p` (a collective over the group: every rank calls it).
  torch::Tensor full(const torch::Tensor& p);

 private:
  Group& group_;
  bool sync_ = true;
  std::vector<std::unique_ptr<Unit>> units_;
  std::unordered_map<const c10::TensorImpl*, Param*> by_impl_;
};

std::unique_ptr<FullyShard> apply_fully_shard(models::Model& model, Group& group, const FullyShardOptions& options);

}  // namespace composer::parallel

// tensor_parallel: shards Linear and Embedding weights over the tp group by a
// plan (module FQN patterns -> styles), and installs the module hooks that
// move activations between layouts with autograd-aware collectives:
//   colwise   weight/bias Shard(0); input gathered (Shard) or its gradient
//             all-reduced (Replicate); output local Shard(-1) or gathered.
//   rowwise   Linear weight Shard(1), bias added once after the reduction;
//             Embedding weight Shard(0) with out-of-range ids masked; output
//             all-reduced (Replicate) or reduce-scattered (Shard(d)).
//   sequence_parallel  norm on sequence-sharded input; its parameters'
//             partial gradients are all-reduced over tp.
//   prepare_input      redistributes a module's input (Shard(1) -> Replicate).
// Every parameter's tp placement goes into the shared Placements: Shard(d)
// for sharded ones, Replicate for the rest; replicated parameters that see
// sharded activations (sequence-parallel norms, biases of rowwise layers with
// sharded output) have Partial gradients, which the gradient synchronisation
// sums over tp, so every tp rank steps the same values.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/model.h"
#include "parallelisms/collectives.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

// '*' matches any run of characters within one dotted segment; '**' any run
// across segments too (`**` alone: every module at every depth).
bool fqn_matches(const std::string& pattern, const std::string& fqn);
bool matches_any(const std::vector<std::string>& patterns, const std::string& fqn);

// The modules `patterns` select (fully_shard's and activation checkpointing's
// units), outermost first, without the root. A matched module without a
// forward of its own (a ModuleList) never runs, so its children stand in for it.
std::vector<std::pair<std::string, nn::Module*>> select_modules(models::Model& model,
                                                                const std::vector<std::string>& patterns);

// Checks a plan against a model without any process group: every pattern
// matches a module, and each style suits the module's type. Returns the
// first problem as "pattern: message", or nullopt.
std::optional<std::string> check_tp_plan(models::Model& model, const models::TpPlan& plan);

// How one parameter is laid out over the tp ranks.
struct TpShard {
  int64_t dim = 0;          // the sharded dim
  int64_t global_size = 0;  // its size before sharding
};

class TensorParallel {
 public:
  TensorParallel(Group& group, Placements& placements) : group_(group), placements_(placements) {}
  Group& group() { return group_; }
  Placements& placements() { return placements_; }
  // The shard layout of a parameter, or nullptr when it is replicated.
  const TpShard* shard_of(const torch::Tensor& p) const;

  // Internal state the hooks share.
  std::unordered_map<const c10::TensorImpl*, TpShard> shards_;

 private:
  Group& group_;
  Placements& placements_;
};

std::unique_ptr<TensorParallel> apply_tensor_parallel(models::Model& model, Group& group,
                                                      const models::TpPlan& plan, Placements& placements);

}  // namespace composer::parallel

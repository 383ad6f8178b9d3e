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
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/config_fields.h"
#include "parallelisms/parallel.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

class TensorParallel;

// The `tensor_parallel` transform's options (docs/configuration.md).
struct TensorParallelConfig {
  static constexpr const char* kKey = "tensor_parallel";
  static constexpr Splits kSplits = Splits::kWidth;
  static constexpr bool kMovesActivations = true;  // layouts change by collectives
  using Runtime = TensorParallel;
  std::vector<std::string> mesh_dim{"tp"};
  std::string plan = "default";
  models::TpPlan styles;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  // Resolved by the planner: the rules applied (the model's plan, or
  // styles) and the module whose logits stay vocabulary-sharded ("": none).
  models::TpPlan rules;
  std::string loss_module;

  template <class V>
  void fields(V& v) {
    v("mesh_dim", mesh_dim, kOneOrList);       // the one mesh dim it shards over
    v("plan", plan);                           // the model's plan (default), or custom (then `styles`)
    v("styles", styles);                       // plan custom: the rules
    v("sequence_parallel", sequence_parallel);  // shard norms and residuals on the sequence dim
    v("loss_parallel", loss_parallel);         // keep the logits sharded over the vocabulary
  }
  std::optional<FieldError> check(const std::set<std::string>&) const {
    if ((plan == "custom") == !styles.empty()) return std::nullopt;
    return FieldError{"", "a custom plan lists its rules in `styles`, and `styles` needs plan: custom"};
  }
};

struct Applying;
struct Tracing;
// Shards the roots' modules by the resolved rules.
bool apply(Applying& a, const TensorParallelConfig& config);
// A stage's edge is sharded as this rank's tensor-parallel coordinate sees it.
void trace(Tracing& t, const TensorParallelConfig& config);

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

  // How many modules a rule of the plan styled on this rank.
  int64_t num_modules() const { return modules_; }

  // Internal state the hooks share.
  std::unordered_map<const c10::TensorImpl*, TpShard> shards_;
  // The tensor each prepare_input gather made last (weakly held) and where
  // the colwise Linears fed by it leave their partial input gradients.
  struct Gathered {
    c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor{
        c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    std::shared_ptr<PartialGrads> partials;
  };
  // Shared with the hooks, which outlive this object (a caller may drop it).
  std::shared_ptr<std::vector<std::shared_ptr<Gathered>>> gathered_ =
      std::make_shared<std::vector<std::shared_ptr<Gathered>>>();
  int64_t modules_ = 0;

 private:
  Group& group_;
  Placements& placements_;
};

// Loss parallel (VocabParallel, parallel.h): the cross entropy of logits
// that stay sharded over the vocabulary.
// The mean over rows of cross entropy between logits sharded on their last
// dim ([rows, this rank's piece of vocab]) and class ids ([rows]): the max
// and the sum of exponentials are all-reduced over the group, and the target's
// logit comes from the rank that holds it, so no rank holds whole logits. Its
// gradient is the local softmax minus the one-hot, with no communication.
// With `sum_kept`, the sum over the rows whose target is not -100 (ignored)
// instead of the mean over all rows.
torch::Tensor vocab_parallel_cross_entropy(const VocabParallel& v, const torch::Tensor& logits,
                                           const torch::Tensor& targets, bool sum_kept = false);
// Forward only: each row's -log softmax(logits)[target] over the whole
// vocabulary (a collective over v.group; a row's value is the same on every
// rank of it). A target outside the vocabulary (-100) gives a meaningless value.
torch::Tensor vocab_parallel_token_nll(const VocabParallel& v, const torch::Tensor& logits,
                                       const torch::Tensor& targets);

// Shards the modules of `roots` (the model, or this rank's pipeline stages)
// that the plan's rules select.
std::unique_ptr<TensorParallel> apply_tensor_parallel(const std::vector<models::Root>& roots, Group& group,
                                                      const models::TpPlan& plan, Placements& placements);
std::unique_ptr<TensorParallel> apply_tensor_parallel(models::Model& model, Group& group,
                                                      const models::TpPlan& plan, Placements& placements);

}  // namespace composer::parallel

// activation_checkpointing composed with the transforms on real Gloo groups:
// under fully_shard the recompute uses the parameters gathered for backward
// (no all-gather more than without checkpointing), under tensor_parallel it
// re-runs the forward collectives, and the gradients are bit-equal to the
// same transform without checkpointing.
#include <gtest/gtest.h>

#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/tensor_parallel.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

models::ModelPtr make_stack() { return testing::seeded_model("mlp_stack", 3, {{"mlp_dim", int64_t{17}}}); }

torch::Tensor input_of(int rank) { return torch::linspace(-1, 1, 4 * 17).view({4, 17}).mul(rank + 1).sin(); }

struct Counts {
  int64_t forward_gathers = 0, backward_gathers = 0, backward_reduce_scatters = 0, recomputes = 0;
  std::vector<torch::Tensor> grads;
};

// One forward and backward of mlp_stack under fully_shard (a unit per MLP),
// with or without checkpointing the same MLPs.
Counts fully_shard_step(Group& g, bool checkpoint, bool reshard) {
  auto m = make_stack();
  std::unique_ptr<ActivationCheckpoint> ac;
  if (checkpoint) ac = apply_activation_checkpointing(*m, {{"*"}, 1});
  auto fs = apply_fully_shard(*m, g, {{"*"}, reshard});
  Counts c;
  g.counter->reset();
  auto y = (*m)(input_of(g.rank));
  c.forward_gathers = g.counter->get("all_gather").calls;
  g.counter->reset();
  y.pow(2).sum().backward();
  c.backward_gathers = g.counter->get("all_gather").calls;
  c.backward_reduce_scatters = g.counter->get("reduce_scatter").calls;
  c.recomputes = ac ? ac->recomputes() : 0;
  for (auto& [n, p] : nn::unique_named_parameters(*m)) c.grads.push_back(p.grad().clone());
  return c;
}

void run_fully_shard(bool reshard) {
  testing::run_ranks({"dp"}, {2}, [reshard](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    Counts plain = fully_shard_step(g, false, reshard);
    Counts ac = fully_shard_step(g, true, reshard);
    EXPECT_EQ(ac.recomputes, 3);
    EXPECT_EQ(ac.forward_gathers, plain.forward_gathers);
    EXPECT_EQ(ac.backward_gathers, plain.backward_gathers);  // the recompute gathers nothing itself
    EXPECT_EQ(ac.backward_gathers, reshard ? 3 : 0);
    EXPECT_EQ(ac.backward_reduce_scatters, 3);
    ASSERT_EQ(ac.grads.size(), plain.grads.size());
    for (size_t i = 0; i < ac.grads.size(); ++i) EXPECT_TRUE(ac.grads[i].equal(plain.grads[i])) << i;
  });
}

TEST(ActivationCheckpoint, UnderFullyShardTheRecomputeUsesTheBackwardGather) { run_fully_shard(true); }
TEST(ActivationCheckpoint, UnderFullyShardWithoutReshardNothingIsGatheredInBackward) { run_fully_shard(false); }

models::TpPlan stack_plan() {
  const auto* spec = models::find_model("mlp_stack");
  models::ModelArgs a;
  for (const auto& arg : spec->args) a.set(arg.name, arg.default_value);
  return spec->tp_plan(a, false);
}

TEST(ActivationCheckpoint, UnderTensorParallelTheRecomputeRerunsTheForwardCollectives) {
  testing::run_ranks({"tp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("tp");
    auto x = torch::linspace(-2, 2, 64).view({4, 16}).cos();
    std::vector<std::vector<torch::Tensor>> grads;
    std::vector<int64_t> backward_reduces;
    for (bool checkpoint : {false, true}) {
      auto m = testing::seeded_model("mlp_stack", 42);
      Placements pl;
      apply_tensor_parallel(*m, g, stack_plan(), pl);
      std::unique_ptr<ActivationCheckpoint> ac;
      if (checkpoint) ac = apply_activation_checkpointing(*m, {{"*"}, 1});
      auto y = (*m)(x);
      g.counter->reset();
      y.pow(2).sum().backward();
      backward_reduces.push_back(g.counter->get("all_reduce").calls);
      if (ac) {
        EXPECT_EQ(ac->recomputes(), 3);
      }
      grads.emplace_back();
      for (auto& [n, p] : nn::unique_named_parameters(*m)) grads.back().push_back(p.grad().clone());
    }
    EXPECT_EQ(backward_reduces[0], 2);      // the two MLPs' input gradients (the first input needs none)
    EXPECT_EQ(backward_reduces[1], 2 + 3);  // and each recomputed MLP's forward all-reduce
    for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(grads[1][i].equal(grads[0][i])) << i;
  });
}

}  // namespace
}  // namespace composer::parallel

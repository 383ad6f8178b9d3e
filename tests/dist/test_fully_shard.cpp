// fully_shard on real Gloo groups: per unit and pass one all-gather and one
// reduce-scatter, unsharded storage really freed after forward, gradients
// equal to the single-device average, and 1-way sharding issues nothing.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "parallelisms/fully_shard.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

// mlp_dim 17: 51 and 68 rows, uneven over the ranks.
models::ModelPtr make_stack() { return testing::seeded_model("mlp_stack", 3, {{"mlp_dim", int64_t{17}}}); }

torch::Tensor input_of(int rank) { return torch::linspace(-1, 1, 4 * 17).view({4, 17}).mul(rank + 1).sin(); }

void run_counts(bool reshard) {
  testing::run_ranks({"dp"}, {2}, [reshard](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, reshard});
    EXPECT_EQ(fs->num_units(), 3u);  // the root owns no parameter of its own
    g.counter->reset();
    auto y = (*m)(input_of(g.rank));
    EXPECT_EQ(g.counter->get("all_gather").calls, 3);
    EXPECT_EQ(g.counter->total().calls, 3);
    g.counter->reset();
    y.sum().backward();
    EXPECT_EQ(g.counter->get("reduce_scatter").calls, 3);
    EXPECT_EQ(g.counter->get("all_gather").calls, reshard ? 3 : 0);  // re-gathered before each unit's backward
    EXPECT_EQ(g.counter->total().calls, reshard ? 6 : 3);
  });
}

TEST(FullyShard, OneAllGatherAndOneReduceScatterPerUnitPerPass) { run_counts(true); }
TEST(FullyShard, WithoutReshardBackwardGathersNothing) { run_counts(false); }

TEST(FullyShard, GradientsAreTheAverageOverRanksAndShardsAreTorchChunks) {
  auto ref = make_stack();
  for (int r = 0; r < 2; ++r) (*ref)(input_of(r)).sum().backward();
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, true});
    (*m)(input_of(g.rank)).sum().backward();
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      auto rp = ref->named_parameters()[n];
      EXPECT_EQ(p.size(0), rp.chunk(2, 0)[g.rank].size(0)) << n;
      auto expect = rp.grad().chunk(2, 0)[g.rank] / 2;
      EXPECT_TRUE(torch::allclose(p.grad(), expect, 1e-5, 1e-6)) << n;
      EXPECT_TRUE(fs->full(p).equal(rp.detach())) << n;
    }
  });
}

TEST(FullyShard, AccumulationReduceScattersOnceAfterTheLastMicrobatch) {
  auto ref = make_stack();
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < 2; ++k) (*ref)(input_of(r) * (k + 1)).sum().backward();
  }
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, true});
    g.counter->reset();
    for (int k = 0; k < 2; ++k) {
      fs->set_requires_sync(k == 1);
      (*m)(input_of(g.rank) * (k + 1)).sum().backward();
      fs->reshard();
      EXPECT_EQ(g.counter->get("reduce_scatter").calls, k == 0 ? 0 : 3);
    }
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      auto expect = ref->named_parameters()[n].grad().chunk(2, 0)[g.rank] / 2;
      EXPECT_TRUE(torch::allclose(p.grad(), expect, 1e-5, 1e-6)) << n;
    }
  });
}

TEST(FullyShard, ReshardAfterForwardFreesTheUnshardedStorage) {
  testing::run_ranks({"dp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, true});
    auto x = input_of(g.rank);
    auto* first = dynamic_cast<nn::Module*>(m->named_modules()["0.in_proj"].get());
    auto weight = m->named_parameters()["0.in_proj.weight"];
    auto y = (*m)(x);
    const auto& full = first->param(weight);
    EXPECT_EQ(full.size(0), 51);                       // the view the layer computed with was full
    EXPECT_EQ(full.storage().nbytes(), 0u);            // and its storage is released after forward
    y.sum().backward();
    EXPECT_TRUE(weight.grad().defined());
  });
}

TEST(FullyShard, OneWayShardingIssuesNoCollective) {
  testing::run_ranks({"dp", "tp"}, {1, 2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, true});
    (*m)(input_of(0)).sum().backward();
    EXPECT_EQ(g.counter->total().calls, 0);
  });
}

}  // namespace
}  // namespace composer::parallel

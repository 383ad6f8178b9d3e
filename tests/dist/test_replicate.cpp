// replicate (DDP) on real Gloo groups, with the gradient synchronisation its
// placements call for: averaged gradients equal the average of each rank's
// single-device gradients, buckets launch in order, gradient accumulation
// synchronises once, rank 0's parameters are broadcast, and a parameter that
// gets no gradient anywhere keeps none.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/replicate.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

models::ModelPtr make_model() { return testing::seeded_model("mlp_stack", 0); }

torch::Tensor input_of(int rank, int micro) {
  std::lock_guard<std::mutex> lock(testing::rng_mutex());
  torch::manual_seed(1000 + 10 * rank + micro);
  return torch::randn({4, 16});
}

std::map<std::string, torch::Tensor> grads_of(models::Model& m) {
  std::map<std::string, torch::Tensor> g;
  for (auto& [n, p] : nn::unique_named_parameters(m)) g[n] = p.grad().clone();
  return g;
}

// The gradients a single device would have if it summed every rank's and
// microbatch's loss and then divided by the number of ranks.
std::map<std::string, torch::Tensor> reference_grads(int ranks, int micro) {
  auto m = make_model();
  for (int r = 0; r < ranks; ++r) {
    for (int k = 0; k < micro; ++k) (*m)(input_of(r, k)).pow(2).sum().backward();
  }
  auto g = grads_of(*m);
  for (auto& [n, t] : g) t.div_(ranks);
  return g;
}

// replicate plus the gradient synchronisation of its placements.
struct Replicated {
  Placements placements;
  std::unique_ptr<GradSync> sync;
};

std::unique_ptr<Replicated> replicate(models::Model& m, Group& g, double bucket_mb = 25) {
  auto r = std::make_unique<Replicated>();
  apply_replicate(m, g, {}, r->placements);
  std::vector<torch::Tensor> params;
  for (auto& [n, p] : nn::unique_named_parameters(m)) params.push_back(p);
  r->sync = std::make_unique<GradSync>(params, r->placements, GradSyncOptions{bucket_mb});
  return r;
}

TEST(Replicate, AveragedGradientsMatchTheSingleDeviceAverage) {
  auto expect = reference_grads(2, 1);
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto m = make_model();
    auto rep = replicate(*m, mesh.group("dp"), /*bucket_mb=*/0.001);
    EXPECT_GT(rep->sync->num_buckets(), 3u);
    (*m)(input_of(mesh.rank(), 0)).pow(2).sum().backward();
    rep->sync->finish();
    for (auto& [n, g] : grads_of(*m)) EXPECT_TRUE(torch::allclose(g, expect.at(n), 1e-5, 1e-6)) << n;
    auto e = mesh.group("dp").counter->get("all_reduce");
    EXPECT_EQ(e.calls, static_cast<int64_t>(rep->sync->num_buckets()));
  });
}

TEST(Replicate, BucketsLaunchWhileBackwardStillRuns) {
  // The overlap: when backward reaches the first layer (its weight's gradient
  // is the last one computed), the buckets of the later layers are already
  // all-reducing.
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto m = make_model();
    auto& dp = mesh.group("dp");
    auto rep = replicate(*m, dp, /*bucket_mb=*/0.001);
    const auto buckets = static_cast<int64_t>(rep->sync->num_buckets());
    ASSERT_GT(buckets, 3);
    int64_t launched_before_last_gradient = -1;
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      if (n != "0.in_proj.weight") continue;
      p.register_hook([&](const torch::Tensor&) { launched_before_last_gradient = dp.counter->get("all_reduce").calls; });
    }
    dp.counter->reset();
    (*m)(input_of(mesh.rank(), 0)).pow(2).sum().backward();
    const int64_t launched_by_backward = dp.counter->get("all_reduce").calls;
    rep->sync->finish();
    EXPECT_GE(launched_before_last_gradient, buckets - 2) << "buckets launched before backward reached layer 0";
    EXPECT_EQ(launched_by_backward, buckets) << "every bucket launched by the end of backward";
    EXPECT_EQ(dp.counter->get("all_reduce").calls, buckets) << "finish launches nothing more";
  });
}

TEST(Replicate, AccumulationSynchronisesOnlyTheLastMicrobatch) {
  auto expect = reference_grads(2, 2);
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto m = make_model();
    auto rep = replicate(*m, mesh.group("dp"));
    EXPECT_EQ(rep->sync->num_buckets(), 1u);
    mesh.group("dp").counter->reset();
    rep->sync->set_requires_sync(false);
    (*m)(input_of(mesh.rank(), 0)).pow(2).sum().backward();
    EXPECT_EQ(mesh.group("dp").counter->total().calls, 0);
    rep->sync->set_requires_sync(true);
    (*m)(input_of(mesh.rank(), 1)).pow(2).sum().backward();
    rep->sync->finish();
    EXPECT_EQ(mesh.group("dp").counter->get("all_reduce").calls, 1);
    for (auto& [n, g] : grads_of(*m)) EXPECT_TRUE(torch::allclose(g, expect.at(n), 1e-5, 1e-6)) << n;
  });
}

TEST(Replicate, RankZeroParametersAreBroadcast) {
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto m = make_model();
    if (mesh.rank() == 1) {
      torch::NoGradGuard g;
      for (auto& p : m->parameters()) p.add_(1.0);
    }
    auto rep = replicate(*m, mesh.group("dp"));
    auto ref = make_model();
    for (auto& [n, p] : nn::unique_named_parameters(*m)) EXPECT_TRUE(p.equal(ref->named_parameters()[n])) << n;
  });
}

// PyTorch leaves the gradient of a parameter that no loss used undefined and
// the optimizer skips it; the synchronisation must not invent zeros for it,
// while a parameter used on one rank only gets that rank's share everywhere.
TEST(Replicate, ParametersWithoutGradientsKeepNone) {
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto m = make_model();
    auto rep = replicate(*m, mesh.group("dp"));
    auto params = nn::unique_named_parameters(*m);
    auto unused = params.front().second;   // never in a loss
    auto one_rank = params.back().second;  // in rank 0's loss only
    auto loss = (*m)(input_of(mesh.rank(), 0)).pow(2).sum();
    auto used = std::vector<torch::Tensor>{};
    for (auto& [n, p] : params) {
      if (!p.is_same(unused) && (mesh.rank() == 0 || !p.is_same(one_rank))) used.push_back(p);
    }
    auto grads = torch::autograd::grad({loss}, used);
    for (size_t i = 0; i < used.size(); ++i) used[i].mutable_grad() = grads[i];
    rep->sync->finish();
    EXPECT_FALSE(unused.grad().defined());
    ASSERT_TRUE(one_rank.grad().defined());
  });
}

}  // namespace
}  // namespace composer::parallel

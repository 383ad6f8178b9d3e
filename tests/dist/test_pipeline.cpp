// pipeline on real Gloo groups (ranks are threads): every schedule computes
// the single-device gradients, and under fully_shard the units stay gathered
// across microbatches and reduce-scatter once, after the last.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/pipeline.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

models::ModelPtr make_layers() {
  return testing::seeded_model("mlp_module_layers", 5, {{"n_layers", int64_t{8}}, {"dim", int64_t{10}}});
}

torch::Tensor microbatch(int mb) { return torch::linspace(-1, 1, 20).view({2, 10}).mul(mb + 1).cos(); }

// Single-device gradients of sum over microbatches of output.sum().
std::map<std::string, torch::Tensor> reference_grads(int microbatches) {
  auto ref = make_layers();
  for (int mb = 0; mb < microbatches; ++mb) (*ref)(microbatch(mb)).sum().backward();
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, p] : nn::unique_named_parameters(*ref)) out[n] = p.grad();
  return out;
}

PipelineOptions options(ScheduleKind kind, int microbatches) {
  PipelineOptions o;
  o.schedule = kind;
  o.virtual_stages = kind == ScheduleKind::kGpipe || kind == ScheduleKind::k1f1b ? 1 : 2;
  o.microbatches = microbatches;
  return o;
}

TEST(Pipeline, EveryScheduleComputesTheSingleDeviceGradients) {
  const auto ref = reference_grads(4);
  for (auto kind : {ScheduleKind::kGpipe, ScheduleKind::k1f1b, ScheduleKind::kInterleaved1f1b, ScheduleKind::kLoopedBfs,
                    ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZbv}) {
    testing::run_ranks({"pp"}, {2}, [&](DeviceMesh& mesh) {
      auto& pp = mesh.group("pp");
      auto m = make_layers();
      Pipeline pipe(*m, pp, options(kind, 4), microbatch(0));
      double loss = pipe.run(microbatch, [](int, const torch::Tensor& y) { return y.sum(); }, 1.0);
      auto t = torch::tensor({loss}, torch::kDouble);
      all_reduce(pp, t);
      double expect = 0;
      {
        auto ref_model = make_layers();
        torch::NoGradGuard no_grad;
        for (int mb = 0; mb < 4; ++mb) expect += (*ref_model)(microbatch(mb)).sum().item<double>();
      }
      EXPECT_NEAR(t.item<double>(), expect, 1e-4) << name_of(kind);
      for (auto& [n, p] : nn::unique_named_parameters(*m)) {
        if (!pipe.holds(p)) {
          EXPECT_EQ(p.numel(), 0) << n << ": a stage this rank does not hold keeps no storage";
          continue;
        }
        EXPECT_TRUE(torch::allclose(p.grad(), ref.at(n), 1e-5, 1e-6)) << name_of(kind) << " " << n;
      }
    });
  }
}

TEST(Pipeline, FullyShardGathersOnceAndReduceScattersOnceAfterTheLastMicrobatch) {
  const auto ref = reference_grads(4);
  testing::run_ranks({"dp", "pp"}, {2, 2}, [&](DeviceMesh& mesh) {
    auto& dp = mesh.group("dp");
    auto& pp = mesh.group("pp");
    auto m = make_layers();
    Pipeline pipe(*m, pp, options(ScheduleKind::k1f1b, 4), microbatch(0));
    FullyShardOptions o;
    o.units = {"layers.*"};
    o.reshard_after_forward = false;
    o.param_filter = [&](const torch::Tensor& p) { return pipe.holds(p); };
    auto fs = apply_fully_shard(*m, dp, o);
    EXPECT_EQ(fs->num_units(), 4u);  // this rank's 4 layers
    dp.counter->reset();
    fs->set_requires_sync(false);
    // Both dp ranks see the same microbatches here, so averaging keeps the sums.
    pipe.run(microbatch, [](int, const torch::Tensor& y) { return y.sum(); }, 1.0);
    EXPECT_EQ(dp.counter->get("all_gather").calls, 4);  // once per unit, not per microbatch
    EXPECT_EQ(dp.counter->get("reduce_scatter").calls, 0);
    fs->flush();
    EXPECT_EQ(dp.counter->get("reduce_scatter").calls, 4);  // once per unit, after the last
    fs->reshard();
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      if (!pipe.holds(p)) continue;
      auto expect = ref.at(n).chunk(2, 0)[dp.rank];
      EXPECT_TRUE(torch::allclose(p.grad(), expect, 1e-5, 1e-6)) << n;
    }
  });
}

}  // namespace
}  // namespace composer::parallel

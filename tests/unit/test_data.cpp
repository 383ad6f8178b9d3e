// Data, losses and schedules: samples are a pure function of (seed, step,
// index), microbatch losses add up to the global-batch loss, schedules follow
// their formulas.
#include <gtest/gtest.h>

#include <cmath>

#include "runner/config.h"
#include "runner/data.h"
#include "runner/optim.h"
#include "runner/trainer.h"

namespace composer {
namespace {

struct Fixture {
  explicit Fixture(const std::string& yaml) : config(parse_config(yaml, "x.yaml")), model(build_model(config)) {
    plan = plan_data(config, *model);
    data = make_dataset(config, plan);
  }
  ExperimentConfig config;
  models::ModelPtr model;
  DataPlan plan;
  std::unique_ptr<DataSet> data;
};

TEST(Data, SplitsOfTheGlobalBatchSeeTheSameSamples) {
  Fixture f("name: t\nmodel: {name: mlp_module}\n");
  Batch whole = f.data->batch(3, 0, 8);
  Batch a = f.data->batch(3, 0, 3), b = f.data->batch(3, 3, 8);
  EXPECT_TRUE(whole.inputs.equal(torch::cat({a.inputs, b.inputs})));
  EXPECT_TRUE(whole.targets.equal(torch::cat({a.targets, b.targets})));
  EXPECT_FALSE(whole.inputs.equal(f.data->batch(4, 0, 8).inputs));
  EXPECT_EQ(whole.inputs.sizes(), (std::vector<int64_t>{8, 10}));
  EXPECT_EQ(whole.targets.sizes(), (std::vector<int64_t>{8, 10}));
}

TEST(Data, TokenModelsGetShiftedNextTokens) {
  Fixture f("name: t\nmodel: {name: transformer}\ntrain: {loss: {name: cross_entropy}}\ndata: {seq_len: 6}\n");
  EXPECT_EQ(f.plan.targets, TargetKind::kNextTokens);
  Batch b = f.data->batch(1, 0, 2);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{2, 6}));
  EXPECT_TRUE(b.inputs.slice(1, 1).equal(b.targets.slice(1, 0, 5)));
  EXPECT_LT(b.inputs.max().item<int64_t>(), 8);
}

TEST(Data, IncompatibleChoicesAreConfigErrors) {
  EXPECT_THROW(Fixture("name: t\nmodel: {name: mlp_module}\ntrain: {loss: {name: sum}}\ndata: {targets: normal}\n"),
               ConfigError);
  EXPECT_THROW(Fixture("name: t\nmodel: {name: mlp_module}\ndata: {inputs: tokens}\n"), ConfigError);
  EXPECT_THROW(Fixture("name: t\nmodel: {name: transformer}\ndata: {seq_len: 17}\n"), ConfigError);
}

TEST(Data, SampleSeedsDiffer) {
  EXPECT_NE(sample_seed(0, 1, 0), sample_seed(0, 1, 1));
  EXPECT_NE(sample_seed(0, 1, 0), sample_seed(0, 2, 0));
  EXPECT_NE(sample_seed(0, 1, 0), sample_seed(1, 1, 0));
  EXPECT_LT(sample_seed(5, 5, 5), uint64_t{1} << 63);
}

TEST(Loss, MicrobatchLossesAddUpToTheGlobalLoss) {
  auto out = torch::randn({8, 5}), tgt = torch::randn({8, 5});
  for (auto kind : {LossKind::kMse, LossKind::kMean, LossKind::kSum}) {
    LossConfig l{kind, 0.5};
    double whole = compute_loss(l, out, tgt, 8, 8).item<double>();
    double parts = compute_loss(l, out.slice(0, 0, 4), tgt.slice(0, 0, 4), 4, 8).item<double>() +
                   compute_loss(l, out.slice(0, 4), tgt.slice(0, 4), 4, 8).item<double>();
    EXPECT_NEAR(whole, parts, 1e-6) << name_of(kind);
  }
  LossConfig ce{LossKind::kCrossEntropy, 1.0};
  auto ids = torch::tensor({1, 0, 4}, torch::kLong);
  double expect = -torch::log_softmax(out.slice(0, 0, 3), -1).gather(1, ids.unsqueeze(1)).mean().item<double>();
  EXPECT_NEAR(compute_loss(ce, out.slice(0, 0, 3), ids, 3, 3).item<double>(), expect, 1e-6);
}

TEST(Schedule, WarmupThenDecay) {
  OptimizerConfig o;
  o.lr = 1.0;
  LrScheduleConfig s;
  s.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(lr_at(o, s, 1, 10), 0.25);
  EXPECT_DOUBLE_EQ(lr_at(o, s, 4, 10), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(o, s, 9, 10), 1.0);
  s.decay = Decay::kLinear;
  s.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(lr_at(o, s, 5, 10), 1.0);
  EXPECT_NEAR(lr_at(o, s, 8, 10), 1.0 - 0.9 * 3 / 6, 1e-12);
  s.decay = Decay::kCosine;
  EXPECT_NEAR(lr_at(o, s, 8, 10), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.5)), 1e-12);
}

TEST(Clip, ScalesToTheMaxNorm) {
  auto p = torch::zeros({2}, torch::requires_grad());
  p.mutable_grad() = torch::tensor({3.0f, 4.0f});
  double n = grad_norm({p});
  EXPECT_NEAR(n, 5.0, 1e-6);
  clip_grads({p}, n, 1.0);
  EXPECT_NEAR(grad_norm({p}), 1.0, 1e-5);
  clip_grads({p}, 1.0, 10.0);  // below the max: unchanged
  EXPECT_NEAR(grad_norm({p}), 1.0, 1e-5);
}

}  // namespace
}  // namespace composer

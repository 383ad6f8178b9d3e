// Data, losses and schedules: samples are a pure function of (seed, step,
// index), microbatch losses add up to the global-batch loss, schedules follow
// their formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "runner/config/config.h"
#include "runner/train/datasets.h"
#include "runner/train/optim.h"
#include "runner/train/build.h"
#include "tests/unit/temp_path.h"

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

// A token file of `ids`, each `width` bytes little-endian; returns its path.
std::string token_file(const std::vector<uint32_t>& ids, int width) {
  static int files = 0;
  const std::string path = composer::testing::temp_path("tokens" + std::to_string(files++) + ".bin");
  std::string bytes;
  for (uint32_t id : ids) {
    for (int k = 0; k < width; ++k) bytes.push_back(static_cast<char>((id >> (8 * k)) & 0xff));
  }
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

std::string token_config(const std::string& path, const std::string& dtype, int vocab = 256) {
  return "name: t\nmodel: {name: transformer, args: {vocab_size: " + std::to_string(vocab) +
         ", max_seq_len: 4}}\ntrain: {loss: {name: cross_entropy}, global_batch: 8}\n"
         "data: {source: tokens, path: " + path + ", token_dtype: " + dtype + "}\n";
}

TEST(Data, TokenFileSamplesAreWindowsAtPositionsDrawnFromTheGlobalIndex) {
  std::vector<uint32_t> ids(300);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(i % 251);
  for (int width : {2, 4}) {
    Fixture f(token_config(token_file(ids, width), width == 2 ? "uint16" : "uint32"));
    Batch whole = f.data->batch(2, 0, 8);
    ASSERT_EQ(whole.inputs.sizes(), (std::vector<int64_t>{8, 4}));
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t start = static_cast<int64_t>(token_window(f.config.seed, 8 + i, 300 - 5 + 1));
      for (int64_t k = 0; k < 4; ++k) {
        EXPECT_EQ(whole.inputs[i][k].item<int64_t>(), ids[start + k]);
        EXPECT_EQ(whole.targets[i][k].item<int64_t>(), ids[start + k + 1]);
      }
    }
    Batch a = f.data->batch(2, 0, 5), b = f.data->batch(2, 5, 8);  // any split sees the same samples
    EXPECT_TRUE(whole.inputs.equal(torch::cat({a.inputs, b.inputs})));
    EXPECT_TRUE(whole.targets.equal(torch::cat({a.targets, b.targets})));
    EXPECT_FALSE(whole.inputs.equal(f.data->batch(3, 0, 8).inputs));
  }
}

TEST(Data, BadTokenFilesAreErrorsNamingTheFile) {
  const std::string odd = token_file({1, 2, 3}, 1);  // 3 bytes: not whole uint16 ids
  EXPECT_THROW(Fixture(token_config(odd, "uint16")), UserError);
  const std::string short_file = token_file({1, 2, 3, 4}, 2);  // fewer than seq_len + 1 = 5 tokens
  EXPECT_THROW(Fixture(token_config(short_file, "uint16")), UserError);
  EXPECT_THROW(Fixture(token_config("/nonexistent/tokens.bin", "uint16")), UserError);
  std::vector<uint32_t> ids(50, 7);
  ids[20] = 300;  // beyond vocab_size 256, read when a sample covers it
  Fixture f(token_config(token_file(ids, 2), "uint16"));
  try {
    for (int step = 1; step <= 20; ++step) f.data->batch(step, 0, 8);
    ADD_FAILURE() << "no sample covered the out-of-vocabulary id";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is 300, outside the model's vocab_size 256"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_config("name: t\nmodel: {name: transformer}\ndata: {token_dtype: uint32}\n", "x.yaml"),
               ConfigError);
  EXPECT_THROW(parse_config("name: t\nmodel: {name: transformer}\ndata: {source: tokens}\n", "x.yaml"),
               ConfigError);
  EXPECT_THROW(Fixture("name: t\nmodel: {name: mlp_module}\ndata: {source: tokens, path: " + token_file(ids, 2) + "}\n"),
               ConfigError);
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

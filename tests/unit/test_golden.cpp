// Golden files: format round trip and a comparator that finds the first divergence.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "tests/unit/temp_path.h"

#include "runner/config/config.h"
#include "runner/verify/golden.h"

namespace composer {
namespace {

class GoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = parse_config("name: g\nmodel: {name: simple_model}\ncheck: {loss_rtol: 1.0e-5, loss_atol: 0, "
                           "param_rtol: 1.0e-5, param_atol: 1.0e-7}\n",
                           "x.yaml");
    for (int s = 1; s <= 3; ++s) {
      StepRecord r;
      r.step = s;
      r.loss = 1.0 / s;
      r.grad_norm = 2.0 / s;
      r.lr = 0.1;
      steps_.push_back(r);
    }
    params_ = {{"a", torch::randn({4, 3})}, {"b", torch::randn({5})}};
    golden_ = make_golden(config_, steps_, params_, "test");
  }
  ExperimentConfig config_;
  std::vector<StepRecord> steps_;
  NamedTensors params_;
  Golden golden_;
};

TEST(Base64, RoundTripsEveryLength) {
  for (int n = 0; n < 10; ++n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += static_cast<char>(i * 37 + 200);
    EXPECT_EQ(base64_decode(base64_encode(s)), s);
  }
  EXPECT_EQ(base64_encode("Man"), "TWFu");
  EXPECT_EQ(base64_encode("Ma"), "TWE=");
  EXPECT_THROW(base64_decode("abc"), std::invalid_argument);
}

TEST_F(GoldenTest, FileRoundTripPreservesEverything) {
  std::string path = testing::temp_path("g.json");
  write_golden(path, golden_);
  Golden g = read_golden(path);
  EXPECT_EQ(g.header["config_hash"], config_hash(config_));
  ASSERT_EQ(g.steps.size(), 3u);
  EXPECT_DOUBLE_EQ(g.steps[2].loss, 1.0 / 3);
  ASSERT_EQ(g.params.size(), 2u);
  EXPECT_TRUE(g.params[0].values.equal(params_[0].second.to(torch::kDouble).flatten()));
  EXPECT_TRUE(compare(g, config_, steps_, params_).ok);
}

TEST_F(GoldenTest, IdenticalRunPasses) {
  auto r = compare(golden_, config_, steps_, params_);
  EXPECT_TRUE(r.ok) << r.first_failure;
  EXPECT_EQ(r.max_param_abs_err, 0.0);
}

TEST_F(GoldenTest, ReportsTheFirstDivergingStep) {
  auto steps = steps_;
  steps[1].loss *= 1.001;
  steps[2].loss *= 1.001;
  auto r = compare(golden_, config_, steps, params_);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.failures, 2);
  EXPECT_EQ(r.step_failures, 2);
  EXPECT_EQ(r.param_failures, 0);
  EXPECT_EQ(r.first_failure.rfind("step 2 loss: expected 0.5, actual 0.5005", 0), 0u) << r.first_failure;
}

TEST_F(GoldenTest, ToleranceIsRespected) {
  auto steps = steps_;
  steps[0].loss *= 1 + 5e-6;  // inside rtol 1e-5
  EXPECT_TRUE(compare(golden_, config_, steps, params_).ok);
}

TEST_F(GoldenTest, ReportsTheParameterAndElement) {
  auto params = params_;
  params[1].second = params[1].second.clone();
  params[1].second[3] += 0.01;
  auto r = compare(golden_, config_, steps_, params);
  EXPECT_FALSE(r.ok);
  EXPECT_EQ(r.first_failure.rfind("parameter b element 3: expected", 0), 0u) << r.first_failure;
  EXPECT_EQ(r.worst_param, "b");
  EXPECT_NEAR(r.max_param_abs_err, 0.01, 1e-6);
  EXPECT_EQ(r.step_failures, 0);
  EXPECT_EQ(r.param_failures, 1);
}

TEST_F(GoldenTest, ReportsTheGradientNormError) {
  auto steps = steps_;
  steps[0].grad_norm *= 2;  // a factor-2 gradient scale
  auto r = compare(golden_, config_, steps, params_);
  EXPECT_FALSE(r.ok);
  EXPECT_NEAR(r.max_grad_norm_rel_err, 1.0, 1e-12);
  EXPECT_EQ(r.max_loss_rel_err, 0.0);
}

TEST_F(GoldenTest, NaNNeverPasses) {
  auto steps = steps_;
  steps[0].grad_norm = std::nan("");
  EXPECT_FALSE(compare(golden_, config_, steps, params_).ok);
}

TEST_F(GoldenTest, MissingAndExtraParametersFail) {
  NamedTensors fewer = {params_[0]};
  EXPECT_NE(compare(golden_, config_, steps_, fewer).first_failure.find("b is in the golden but not in the run"),
            std::string::npos);
  auto more = params_;
  more.emplace_back("c", torch::ones({1}));
  EXPECT_NE(compare(golden_, config_, steps_, more).first_failure.find("c is in the run but not in the golden"),
            std::string::npos);
}

TEST_F(GoldenTest, StaleGoldenIsRejected) {
  auto other = parse_config("name: g\nseed: 9\nmodel: {name: simple_model}\n", "x.yaml");
  EXPECT_THROW(compare(golden_, other, steps_, params_), CheckFailed);
}

TEST_F(GoldenTest, AMixedPrecisionGoldenNeedsAPlanThatComputesTheSameWay) {
  // The policy survives the file (the reference writes it into the header).
  Golden g = golden_;
  g.header["param_dtype"] = "bfloat16";
  g.header["reduce_dtype"] = "float32";
  const std::string path = testing::temp_path("mixed.json");
  write_golden(path, g);
  Golden mixed = read_golden(path);
  auto with = [&](const std::string& fully_shard) {
    return parse_config("name: g\nmodel: {name: simple_model}\nmesh: {shape: [2], names: [dp]}\nparallelize:\n"
                        "  - fully_shard: {mesh_dim: dp" + fully_shard + "}\n", "x.yaml");
  };
  EXPECT_TRUE(compare(mixed, with(", param_dtype: bfloat16, reduce_dtype: float32"), steps_, params_).ok);
  try {
    compare(mixed, with(""), steps_, params_);
    ADD_FAILURE() << "a float32 plan compared with a bfloat16 golden";
  } catch (const CheckFailed& e) {
    EXPECT_NE(std::string(e.what()).find("trained with bfloat16 compute, float32 gradient reduction"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("this plan computes with no mixed precision"), std::string::npos) << e.what();
  }
  // reduce_dtype defaults to param_dtype: bfloat16 reductions are another policy.
  EXPECT_THROW(compare(mixed, with(", param_dtype: bfloat16"), steps_, params_), CheckFailed);
  EXPECT_THROW(compare(mixed, with(", all_gather: bfloat16"), steps_, params_), CheckFailed);

  // The bfloat16 all-gather rounds the parameters only: its own policy. split_bfloat16 is exact.
  Golden rounded = golden_;
  rounded.header["all_gather"] = "bfloat16";
  write_golden(path, rounded);
  rounded = read_golden(path);
  EXPECT_TRUE(compare(rounded, with(", all_gather: bfloat16"), steps_, params_).ok);
  EXPECT_THROW(compare(rounded, with(", all_gather: split_bfloat16"), steps_, params_), CheckFailed);
  EXPECT_THROW(compare(rounded, with(", param_dtype: bfloat16, reduce_dtype: float32"), steps_, params_), CheckFailed);
}

TEST_F(GoldenTest, NonIntegerCountsAreFileErrors) {
  // A float where an integer belongs (found by fuzzing: nlohmann casts it, undefined out of range).
  std::string path = testing::temp_path("g.json");
  write_golden(path, golden_);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"step\": 2", "\"step\": 4.5e+124"},
           {"\"format_version\": 1", "\"format_version\": 1e300"},
           {"\"shape\": [\n    4,", "\"shape\": [\n    -4,"},
           {"\"shape\": [\n    4,", "\"shape\": [\n    9223372036854775807,"}}) {
    auto at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    std::string bad = text;
    bad.replace(at, from.size(), to);
    EXPECT_THROW(parse_golden(bad, "g.json"), FileError) << to;
  }
}

TEST_F(GoldenTest, DegenerateStepsAreNamed) {
  EXPECT_FALSE(degenerate_steps(steps_).has_value());
  auto dead = steps_;
  dead[1].loss = 0;
  dead[2].loss = 0;
  EXPECT_EQ(degenerate_steps(dead).value_or(""), "loss is 0 at step(s) 2, 3");
  auto flat = steps_;
  for (auto& r : flat) r.grad_norm = 0.5;
  EXPECT_EQ(degenerate_steps(flat).value_or(""), "grad_norm is the same at every step");
  EXPECT_FALSE(degenerate_steps({steps_[0]}).has_value());  // one step cannot be constant
}

TEST_F(GoldenTest, LargeTensorsKeepASampleAndTheirNorm) {
  NamedTensors big = {{"w", torch::randn({kGoldenFullLimit + 7})}};
  Golden g = make_golden(config_, steps_, big, "test");
  ASSERT_TRUE(g.params[0].sampled);
  EXPECT_EQ(g.params[0].values.numel(), kGoldenSamples);
  EXPECT_TRUE(compare(g, config_, steps_, big).ok);
  auto shifted = big;
  shifted[0].second = big[0].second * 1.01;
  EXPECT_FALSE(compare(g, config_, steps_, shifted).ok);
}

TEST(GoldenFile, MissingAndMalformedFilesAreFileErrors) {
  EXPECT_THROW(read_golden("/nonexistent/golden.json"), FileError);
  std::string path = testing::temp_path("bad.json");
  std::ofstream(path) << "{\"format_version\": 1, \"steps\": 3}";
  EXPECT_THROW(read_golden(path), FileError);
}

}  // namespace
}  // namespace composer

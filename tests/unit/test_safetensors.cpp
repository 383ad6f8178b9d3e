// safetensors: round trips, and every malformed file is a FileError naming the problem.
#include <gtest/gtest.h>

#include "tests/unit/temp_path.h"

#include <fstream>

#include "models/registry.h"
#include "runner/checkpoint.h"
#include "runner/config.h"
#include "runner/safetensors.h"
#include "runner/trainer.h"

namespace composer {
namespace {

std::string error_of(const std::string& bytes) {
  try {
    parse_safetensors(bytes, "w.safetensors");
  } catch (const FileError& e) {
    return e.what();
  }
  return "no error";
}

std::string with_header(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}

TEST(Safetensors, RoundTripKeepsNamesDtypesShapesAndValues) {
  NamedTensors in = {{"a", torch::randn({3, 4})},
                     {"b", torch::arange(5, torch::kLong)},
                     {"c", torch::randn({2}).to(torch::kBFloat16)},
                     {"d", torch::randn({2, 0})},
                     {"e", torch::randn({1}, torch::kDouble)}};
  auto out = parse_safetensors(serialize_safetensors(in, {{"format", "pt"}}), "mem");
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out[i].first, in[i].first);
    EXPECT_EQ(out[i].second.scalar_type(), in[i].second.scalar_type());
    EXPECT_TRUE(out[i].second.equal(in[i].second)) << in[i].first;
  }
}

TEST(Safetensors, FileRoundTrip) {
  std::string path = testing::temp_path("rt.safetensors");
  write_safetensors(path, {{"w", torch::ones({2, 2})}});
  auto t = read_safetensors(path);
  EXPECT_TRUE(t.at(0).second.equal(torch::ones({2, 2})));
}

TEST(Safetensors, TooShortFile) {
  EXPECT_NE(error_of("abc").find("shorter than the 8-byte header length"), std::string::npos);
}

TEST(Safetensors, HeaderLengthBeyondFile) {
  std::string bytes = with_header("{}", "");
  bytes[0] = 100;
  EXPECT_NE(error_of(bytes).find("header claims 100 bytes"), std::string::npos) << error_of(bytes);
}

TEST(Safetensors, TruncatedData) {
  std::string good = serialize_safetensors({{"w", torch::ones({4, 4})}});
  std::string e = error_of(good.substr(0, good.size() - 10));
  EXPECT_NE(e.find("tensor 'w': data_offsets [0, 64] lie outside"), std::string::npos) << e;
}

TEST(Safetensors, HeaderLiesAboutSize) {
  std::string e = error_of(with_header(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 0)));
  EXPECT_NE(e.find("shape and dtype need 12 bytes but data_offsets give 8"), std::string::npos) << e;
}

TEST(Safetensors, BadJsonAndBadEntries) {
  EXPECT_NE(error_of(with_header("{not json", "")).find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}})", std::string(4, 0)))
                .find("unsupported dtype"),
            std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", std::string(4, 0)))
                .find("negative or non-integer"),
            std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"w":{"dtype":"F32","shape":[1]}})", "")).find("needs dtype, shape and data_offsets"),
            std::string::npos);
  EXPECT_NE(error_of(with_header(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
                                 std::string(4, 0)))
                .find("larger than the file's data section"),
            std::string::npos);
}

TEST(Safetensors, MissingFile) { EXPECT_THROW(read_safetensors("/nonexistent.safetensors"), FileError); }

class LoadWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = parse_config("name: t\nmodel: {name: simple_model}\n", "x.yaml");
    model_ = build_model(config_);
    path_ = testing::temp_path("w.safetensors");
  }
  std::string load_error(const NamedTensors& t) {
    write_safetensors(path_, t);
    try {
      load_weights(*model_, path_);
    } catch (const FileError& e) {
      return e.what();
    }
    return "no error";
  }
  ExperimentConfig config_;
  models::ModelPtr model_;
  std::string path_;
};

TEST_F(LoadWeights, LoadsEveryTensorByName) {
  auto other = build_model(config_);
  NamedTensors t = snapshot_params(*other);
  for (auto& [n, v] : t) v = torch::full_like(v, 0.5);
  write_safetensors(path_, t);
  load_weights(*model_, path_);
  EXPECT_TRUE(model_->named_parameters()["net2.bias"].eq(0.5).all().item<bool>());
}

TEST_F(LoadWeights, MissingUnexpectedAndMisshapedAreNamed) {
  NamedTensors t = snapshot_params(*model_);
  auto missing = NamedTensors(t.begin() + 1, t.end());
  EXPECT_NE(load_error(missing).find("missing tensor 'net1.weight'"), std::string::npos);
  auto extra = t;
  extra.emplace_back("net9.weight", torch::ones({1}));
  EXPECT_NE(load_error(extra).find("unexpected tensor 'net9.weight'"), std::string::npos);
  auto bad = t;
  bad[0].second = torch::ones({3, 3});
  EXPECT_NE(load_error(bad).find("tensor 'net1.weight' has shape [3, 3] but the model's is [8, 5]"), std::string::npos)
      << load_error(bad);
}

}  // namespace
}  // namespace composer

namespace composer {
namespace {

std::string index_error(const std::string& text) {
  try {
    parse_checkpoint_index(text, "ck/index.json");
  } catch (const FileError& e) {
    return e.what();
  }
  return "no error";
}

const char* kIndexHead =
    R"({"format": "composer-checkpoint", "version": 1, "step": 4, "world_size": 2, "config_hash": "ab",
        "files": [{"name": "rank-00000.safetensors", "fnv1a64": "00"}], "tensors": )";

TEST(CheckpointIndex, AWellFormedIndexParses) {
  auto x = parse_checkpoint_index(std::string(kIndexHead) +
                                      R"({"w": {"dtype": "F32", "shape": [4, 2], "chunks": [
                                         {"file": "rank-00000.safetensors", "offset": [2, 0], "size": [2, 2]}]}}})",
                                  "ck/index.json");
  EXPECT_EQ(x.step, 4);
  EXPECT_EQ(x.world_size, 2);
  ASSERT_EQ(x.tensors.count("w"), 1u);
  EXPECT_EQ(x.tensors["w"].chunks[0].offset, (std::vector<int64_t>{2, 0}));
}

TEST(CheckpointIndex, MalformedIndexesAreFileErrorsNamingTheProblem) {
  auto with = [](const std::string& tensors) { return index_error(std::string(kIndexHead) + tensors + "}"); };
  EXPECT_NE(index_error("{").find("ck/index.json: checkpoint index is not valid JSON"), std::string::npos);
  EXPECT_NE(index_error(R"({"format": "x"})").find("not a composer checkpoint index"), std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [4], "chunks": [{"file": "other", "offset": [0], "size": [4]}]}})")
                .find("a chunk names a file the index does not list"),
            std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [4], "chunks": [{"file": "rank-00000.safetensors",
                   "offset": [3], "size": [2]}]}})")
                .find("a chunk lies outside the tensor's shape"),
            std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [4], "chunks": [{"file": "rank-00000.safetensors",
                   "offset": [0, 0], "size": [4]}]}})")
                .find("one entry per dim"),
            std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [-4], "chunks": []}})").find("non-negative integers"),
            std::string::npos);
  EXPECT_NE(index_error(R"({"format": "composer-checkpoint", "version": 1, "step": 1, "world_size": 1,
                           "config_hash": "a", "files": [{"name": "../x", "fnv1a64": "0"}], "tensors": {}})")
                .find("must be a plain name inside the checkpoint folder"),
            std::string::npos);
}

}  // namespace
}  // namespace composer

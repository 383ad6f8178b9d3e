// safetensors: round trips, and every malformed file is a FileError naming the problem.
#include <gtest/gtest.h>

#include "tests/unit/temp_path.h"

#include <fstream>

#include "models/registry.h"
#include "runner/checkpoint/checkpoint.h"
#include "runner/config/config.h"
#include "runner/checkpoint/export.h"
#include "runner/base/safetensors.h"
#include "runner/train/build.h"

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

TEST(Safetensors, StreamingWriterWritesTheSameBytesAsWriteSafetensors) {
  NamedTensors in = {{"a", torch::randn({3, 5})}, {"b", torch::arange(7, torch::kLong)}, {"c", torch::randn({})}};
  std::string path = testing::temp_path("stream.safetensors");
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [n, t] : in) entries.push_back({n, t.scalar_type(), t.sizes().vec()});
  SafetensorsWriter w(path, entries, {{"format", "pt"}});
  for (const auto& [n, t] : in) w.write(t);
  w.finish();
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, serialize_safetensors(in, {{"format", "pt"}}));
  EXPECT_EQ(w.size(), bytes.size());
}

TEST(Export, ByteSizesParseWithUnitsAndBadOnesAreNamed) {
  EXPECT_EQ(parse_byte_size("5GB", "--max-shard-size"), 5000000000u);
  EXPECT_EQ(parse_byte_size("64KiB", "--max-shard-size"), 65536u);
  EXPECT_EQ(parse_byte_size("1000", "--max-shard-size"), 1000u);
  for (const char* bad : {"", "0", "5 GB", "GB", "-1", "5TB"}) {
    try {
      parse_byte_size(bad, "--max-shard-size");
      ADD_FAILURE() << bad << " parsed";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("--max-shard-size " + std::string(bad) + ": expected a positive size"),
                std::string::npos);
    }
  }
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
    R"({"format": "composer-checkpoint", "version": 2, "step": 4, "world_size": 2, "config_hash": "ab",
        "hash_block_bytes": 1048576,
        "files": [{"name": "rank-00000.safetensors", "fnv1a64": "00", "header_fnv1a64": "01", "rng_fnv1a64": ["02"]}],
        "tensors": )";

TEST(CheckpointIndex, AWellFormedIndexParses) {
  auto x = parse_checkpoint_index(std::string(kIndexHead) +
                                      R"({"w": {"dtype": "F32", "shape": [4, 2], "chunks": [
                                         {"file": "rank-00000.safetensors", "offset": [2, 0], "size": [2, 2],
                                          "fnv1a64": ["03"]}]}}})",
                                  "ck/index.json");
  EXPECT_EQ(x.step, 4);
  EXPECT_EQ(x.world_size, 2);
  ASSERT_EQ(x.tensors.count("w"), 1u);
  EXPECT_EQ(x.tensors["w"].chunks[0].offset, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(x.tensors["w"].chunks[0].block_hashes, (std::vector<std::string>{"03"}));
  EXPECT_EQ(x.files["rank-00000.safetensors"].header_hash, "01");
  EXPECT_EQ(x.files["rank-00000.safetensors"].rng_hashes, (std::vector<std::string>{"02"}));
}

TEST(CheckpointIndex, BlockHashesCoverEveryByteInBlocks) {
  const std::string bytes = "abcdefghij";
  auto h = block_hashes(bytes.data(), bytes.size(), 4);
  ASSERT_EQ(h.size(), 3u);  // 4 + 4 + 2 bytes
  EXPECT_EQ(h[2], hex64(fnv1a64("ij", 2)));
  EXPECT_EQ(hex64(fnv1a64("", 0)), "cbf29ce484222325");  // FNV-1a 64's offset basis
  EXPECT_EQ(hex64(fnv1a64("a", 1)), "af63dc4c8601ec8c");  // the published FNV-1a 64 of "a"
  EXPECT_TRUE(block_hashes(bytes.data(), 0).empty());
}

TEST(CheckpointIndex, MalformedIndexesAreFileErrorsNamingTheProblem) {
  auto with = [](const std::string& tensors) { return index_error(std::string(kIndexHead) + tensors + "}"); };
  EXPECT_NE(index_error("{").find("ck/index.json: checkpoint index is not valid JSON"), std::string::npos);
  EXPECT_NE(index_error(R"({"format": "x"})").find("not a composer checkpoint index"), std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [4], "chunks": [{"file": "other", "offset": [0], "size": [4],
                   "fnv1a64": []}]}})")
                .find("a chunk names a file the index does not list"),
            std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [4], "chunks": [{"file": "rank-00000.safetensors",
                   "offset": [3], "size": [2], "fnv1a64": []}]}})")
                .find("a chunk lies outside the tensor's shape"),
            std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [4], "chunks": [{"file": "rank-00000.safetensors",
                   "offset": [0, 0], "size": [4], "fnv1a64": []}]}})")
                .find("one entry per dim"),
            std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [-4], "chunks": []}})").find("non-negative integers"),
            std::string::npos);
  EXPECT_NE(index_error(R"({"format": "composer-checkpoint", "version": 2, "step": 1, "world_size": 1,
                           "config_hash": "a", "hash_block_bytes": 1048576, "files": [{"name": "../x",
                           "fnv1a64": "0", "header_fnv1a64": "0", "rng_fnv1a64": []}], "tensors": {}})")
                .find("must be a plain name inside the checkpoint folder"),
            std::string::npos);
  EXPECT_NE(with(R"({"w": {"dtype": "F32", "shape": [4], "chunks": [{"file": "rank-00000.safetensors",
                   "offset": [0], "size": [4]}]}})")
                .find("tensor 'w''s chunk has no 'fnv1a64'"),
            std::string::npos);
  EXPECT_NE(index_error(R"({"format": "composer-checkpoint", "version": 1})").find("unsupported checkpoint version 1"),
            std::string::npos);
}

}  // namespace
}  // namespace composer

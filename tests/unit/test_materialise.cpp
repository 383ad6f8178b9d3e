// Building only what a rank holds (runner/train/materialise.h): a model built under
// nn::DeferInit and materialised gets exactly a single-device build's values
// (and leaves the generator where that build leaves it), keeps only this
// rank's piece, and never holds much more than that piece plus one tensor.
#include <gtest/gtest.h>

#include <fstream>
#include <cstdio>
#include <sstream>

#include "models/registry.h"
#include "parallelisms/per_rank.h"
#include "runner/checkpoint/checkpoint.h"
#include "runner/train/materialise.h"
#include "runner/base/safetensors.h"
#include "tests/unit/temp_path.h"
#include "tests/unit/counting_allocator.h"
#include "tests/unit/small_args.h"

namespace composer {
namespace {

using testing::small_args;

// A model built on meta with its initialisations recorded.
struct Deferred {
  models::ModelPtr model;
  std::vector<nn::DeferInit::Step> steps;
};

Deferred build_deferred(const models::ModelSpec& spec, const models::ModelArgs& args, uint64_t seed) {
  torch::manual_seed(seed);
  nn::DeferInit defer;
  Deferred d;
  d.model = spec.build(args);
  d.steps = defer.steps();
  return d;
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Models whose initialisation a deferred build cannot replay, so every rank
// builds them whole (the trainer's fallback): TransformerWithSharedParams
// copies layer 0's linear biases into the other layers, as nn.Transformer's
// deep copy does, and its attention and BatchNorm set values directly.
bool builds_whole(const models::ModelSpec& spec) { return spec.name == "transformer_with_shared_params"; }

TEST(Materialise, EveryModelGetsTheSingleDeviceValuesAndGeneratorState) {
  for (const auto& spec : models::registry()) {
    if (builds_whole(spec)) continue;
    const auto args = small_args(spec);
    torch::manual_seed(11);
    auto full = spec.build(args);
    const auto after_full = torch::rand({4});  // where the build left the generator
    Deferred d = build_deferred(spec, args, 11);
    for (auto& [name, p] : nn::unique_named_parameters(*d.model)) EXPECT_TRUE(p.is_meta()) << spec.name << " " << name;
    materialise(*d.model, d.steps, {});
    const auto after_deferred = torch::rand({4});
    EXPECT_TRUE(after_full.equal(after_deferred)) << spec.name << ": the generator stream differs";
    auto want = full->named_parameters(/*recurse=*/true);
    for (auto& [name, p] : nn::unique_named_parameters(*d.model)) {
      ASSERT_FALSE(p.is_meta()) << spec.name << " " << name;
      EXPECT_TRUE(p.equal(want[name])) << spec.name << " " << name << " differs from the single-device build";
      EXPECT_TRUE(p.requires_grad()) << spec.name << " " << name;
    }
  }
}

TEST(Materialise, EveryModelRecordsEveryInitialisation) {
  for (const auto& spec : models::registry()) {
    Deferred d = build_deferred(spec, small_args(spec), 1);
    // A model that is built whole must be detected as such, or it would be materialised wrongly.
    EXPECT_EQ(fully_recorded(*d.model, d.steps), !builds_whole(spec))
        << spec.name << (builds_whole(spec) ? " is recorded now: drop it from builds_whole"
                                            : " sets a parameter or buffer outside nn::new_param");
  }
}

// A model that draws a parameter's values directly: a deferred build cannot replay it.
struct DirectInit : models::Model {
  DirectInit() : Model("DirectInit") {
    w = register_parameter("w", torch::empty({4, 4}, nn::param_options()));
    torch::nn::init::normal_(w);
  }
  torch::Tensor forward(torch::Tensor x) override { return x.matmul(w); }
  models::InputSpec input_spec() const override { return {false, 4}; }
  torch::Tensor w;
};

TEST(Materialise, AModelThatInitialisesDirectlyIsNotFullyRecorded) {
  nn::DeferInit defer;
  DirectInit m;
  EXPECT_FALSE(fully_recorded(m, defer.steps()));
}

TEST(Materialise, CastsToTheTrainingDtypeAsModuleToDoes) {
  const auto* spec = models::find_model("mlp_module");
  torch::manual_seed(3);
  auto full = spec->build(small_args(*spec));
  full->to(torch::kBFloat16);
  Deferred d = build_deferred(*spec, small_args(*spec), 3);
  d.model->to(torch::kBFloat16);
  MaterialiseOptions o;
  o.dtype = torch::kBFloat16;
  materialise(*d.model, d.steps, o);
  auto want = full->named_parameters(/*recurse=*/true);
  for (auto& [name, p] : nn::unique_named_parameters(*d.model)) {
    EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(p.equal(want[name])) << name;
  }
}

// Shards every parameter on dim 0 over 4 ranks as fully_shard records it,
// and shrinks the meta parameter to the piece, as the transform does.
parallel::Placements shard_over_four(models::Model& model, int rank) {
  parallel::Placements placements;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    auto& spec = placements.of(p);
    spec.dims.push_back({"dp", nullptr, 4, rank, parallel::Placement::shard(0), parallel::Placement::shard(0)});
    p.set_data(torch::empty(spec.local_shape(), p.options()));
  }
  return placements;
}

TEST(Materialise, KeepsThisRanksPieceAndPeaksAtOneTensorAboveIt) {
  const auto* spec = models::find_model("mlp_module_layers");
  auto args = small_args(*spec);
  args.set("n_layers", int64_t{8});
  args.set("dim", int64_t{256});
  torch::manual_seed(5);
  auto full = spec->build(args);
  int64_t total = 0, largest = 0;
  for (auto& [name, p] : nn::unique_named_parameters(*full)) {
    total += p.nbytes();
    largest = std::max<int64_t>(largest, p.nbytes());
  }
  auto want = full->named_parameters(/*recurse=*/true);
  auto& counter = testing::CountingAllocator::installed();
  for (int rank : {0, 3}) {
    Deferred d = build_deferred(*spec, args, 5);
    parallel::Placements placements = shard_over_four(*d.model, rank);
    MaterialiseOptions o;
    o.placements = &placements;
    const int64_t before = counter.live();
    counter.reset_peak();
    materialise(*d.model, d.steps, o);
    const int64_t held = counter.live() - before, peak = counter.peak() - before;
    EXPECT_EQ(held, total / 4) << "rank " << rank << " holds more than its quarter";
    EXPECT_LE(peak, held + largest + largest / 4) << "rank " << rank;
    EXPECT_LT(peak, total / 2) << "rank " << rank << " built much of the model";
    for (auto& [name, p] : nn::unique_named_parameters(*d.model)) {
      EXPECT_TRUE(p.equal(parallel::local_piece(*placements.find(p), want[name]))) << "rank " << rank << " " << name;
    }
  }
}

TEST(Materialise, PipelineRanksKeepNothingOfOtherStages) {
  const auto* spec = models::find_model("mlp_module_layers");
  Deferred d = build_deferred(*spec, small_args(*spec), 5);
  parallel::Placements placements;
  auto params = nn::unique_named_parameters(*d.model);
  auto& first = placements.of(params.front().second);  // held by pipeline rank 1 only; this is rank 0
  parallel::SpecDim pp{"pp", nullptr, 2, 0, parallel::Placement::replicate(), parallel::Placement::partial()};
  pp.members = {1};
  first.dims.push_back(pp);
  params.front().second.set_data(torch::empty({0}, params.front().second.options()));
  MaterialiseOptions o;
  o.placements = &placements;
  materialise(*d.model, d.steps, o);
  EXPECT_EQ(params.front().second.numel(), 0);
  EXPECT_FALSE(params.front().second.is_meta());
  EXPECT_GT(params.back().second.numel(), 0);
}

// Per-rank parameters (the experts of a mixture of experts) are placed as
// the stack of every rank's copy; materialising keeps the rank's whole copy:
// the single-device values, or with own_seed the values a whole build under
// that seed gives them, leaving the generator where the seed-11 build leaves it.
TEST(Materialise, PerRankParametersKeepTheirWholeOwnValues) {
  const auto* spec = models::find_model("mixture_of_experts");
  const auto args = small_args(*spec);
  torch::manual_seed(11);
  auto full = spec->build(args);
  const auto after_full = torch::rand({4});
  torch::manual_seed(43);
  auto own_build = spec->build(args);
  auto want = full->named_parameters(/*recurse=*/true), own_want = own_build->named_parameters(/*recurse=*/true);
  for (int64_t seed : {int64_t{-1}, int64_t{43}}) {
    Deferred d = build_deferred(*spec, args, 11);
    parallel::Group group;  // rank 1 of 2; recording placements moves nothing
    group.name = "dp";
    group.size = 2;
    group.rank = 1;
    group.ranks = {0, 1};
    parallel::Placements placements;
    const parallel::ParamSet own = parallel::apply_per_rank({models::whole(*d.model)}, group, {"module.2"}, placements);
    ASSERT_FALSE(own.empty());
    MaterialiseOptions o;
    o.placements = &placements;
    o.own = &own;
    o.own_seed = seed;
    materialise(*d.model, d.steps, o);
    EXPECT_TRUE(after_full.equal(torch::rand({4}))) << "seed " << seed << ": the generator stream differs";
    for (auto& [name, p] : nn::unique_named_parameters(*d.model)) {
      const bool mine = own.count(p.unsafeGetTensorImpl());
      const torch::Tensor& expected = mine && seed >= 0 ? own_want[name] : want[name];
      EXPECT_TRUE(p.equal(expected)) << "seed " << seed << " " << name;
    }
  }
  EXPECT_FALSE(own_want["module.2.weight"].equal(want["module.2.weight"]));  // the seeds draw differently
}

TEST(Materialise, WritesTheInitFileASingleDeviceRunWrites) {
  const auto* spec = models::find_model("llama");  // its embedding's values are drawn last, written out of order
  const auto args = small_args(*spec);
  const std::string want_path = testing::temp_path("want.safetensors"), got_path = testing::temp_path("got.safetensors"),
                    other_path = testing::temp_path("other.safetensors");
  // A single-device build from `seed`, its weights saved to `path`.
  auto saved_build = [&](uint64_t seed, const std::string& path) {
    torch::manual_seed(seed);
    auto m = spec->build(args);
    save_weights(*m, path);
    return m;
  };
  saved_build(9, want_path);
  MaterialiseOptions o;
  o.write_init = got_path;
  Deferred d = build_deferred(*spec, args, 9);
  materialise(*d.model, d.steps, o);
  EXPECT_EQ(file_bytes(got_path), file_bytes(want_path));

  // init_from: the file's values (the draws still run), read one tensor at a time.
  auto other = saved_build(1, other_path);
  Deferred e = build_deferred(*spec, args, 9);
  o.write_init.clear();
  const auto source = WeightSource::file(other_path);
  o.init = source.get();
  materialise(*e.model, e.steps, o);
  auto want = other->named_parameters(/*recurse=*/true);
  for (auto& [name, p] : nn::unique_named_parameters(*e.model)) EXPECT_TRUE(p.equal(want[name])) << name;
  for (const auto& path : {want_path, got_path, other_path}) std::remove(path.c_str());
}

}  // namespace
}  // namespace composer

// TransformerWithSharedParams (docs/scenarios.md M9) under fully_shard on real
// Gloo groups, with a unit per encoder and decoder layer and the root:
// 5.13 (test_transformer_no_grad): after a training step the eval-mode output
// equals the output under no_grad; 5.9 (test_param_change_after_init): an
// in-place change of a parameter after fully_shard reaches the next forward.
// Both also with bfloat16 param_dtype (the seed's mixed-precision variants).
// And the buffers: never sharded, never given gradients, each rank's own.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "parallelisms/fully_shard.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

namespace F = torch::nn::functional;

models::ModelPtr make_model(const std::string& mode) {
  return testing::seeded_model("transformer_with_shared_params", 0, {{"mode", mode}});
}

// Sample `i` of the seed's layout, src (6, 2) ++ tgt (4, 2): sample 0 is the seed's get_input().
torch::Tensor sample(int64_t i) {
  auto src = (torch::arange(12, torch::kLong) * (i + 1)).remainder(23);
  auto tgt = (torch::arange(8, torch::kLong) + 3 * i).remainder(23);
  return torch::cat({src, tgt}).view({1, 20});
}

torch::Tensor targets_of(const torch::Tensor& ids) { return ids.narrow(1, 12, 8).reshape({-1}); }

FullyShardOptions layer_units(bool mixed) {
  FullyShardOptions o{{"transformer.encoder.layers.*", "transformer.decoder.layers.*"}, true};
  if (mixed) o.param_dtype = torch::kBFloat16;
  return o;
}

// The seed's loss: cross_entropy(out.view(-1, 23), tgt.view(-1), reduction="sum").
torch::Tensor loss_of(const torch::Tensor& out, const torch::Tensor& ids) {
  return F::cross_entropy(out.reshape({-1, 23}).to(torch::kFloat), targets_of(ids),
                          F::CrossEntropyFuncOptions().reduction(torch::kSum));
}

void no_grad_equals_eval(const std::string& mode, bool mixed) {
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_model(mode);
    auto fs = apply_fully_shard(*m, g, layer_units(mixed));
    std::vector<torch::Tensor> params;
    for (auto& [name, p] : nn::unique_named_parameters(*m)) params.push_back(p);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01).momentum(0.9));
    auto ids = sample(g.rank);
    auto before = m->named_buffers()["bn.running_mean"].clone();
    auto train_out = (*m)(ids);
    loss_of(train_out, ids).backward();
    fs->reshard();
    opt.step();
    auto stats = m->named_buffers()["bn.running_mean"].clone();
    // In train mode the step's forward moved the running statistics; in eval mode nothing did.
    EXPECT_EQ(stats.equal(before), mode == "eval");
    m->eval();
    auto eval_out = (*m)(ids).detach();
    fs->reshard();
    torch::Tensor no_grad_out;
    {
      torch::NoGradGuard no_grad;
      no_grad_out = (*m)(ids);
    }
    fs->reshard();
    EXPECT_TRUE(eval_out.equal(no_grad_out))
        << "max difference " << (eval_out - no_grad_out).abs().max().item<double>();
    EXPECT_TRUE(m->named_buffers()["bn.running_mean"].equal(stats));  // eval forwards move nothing
    // Not vacuous: the step changed the output.
    EXPECT_FALSE(eval_out.equal(train_out.detach()));
  });
}

TEST(TransformerWithSharedParams, NoGradOutputEqualsEvalOutputAfterAStep) { no_grad_equals_eval("eval", false); }
TEST(TransformerWithSharedParams, NoGradOutputEqualsEvalOutputAfterATrainModeStep) {
  no_grad_equals_eval("train", false);
}
TEST(TransformerWithSharedParams, NoGradOutputEqualsEvalOutputMixedPrecision) { no_grad_equals_eval("eval", true); }

void param_change_persists(bool mixed) {
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto ids = sample(0);  // identical on every rank, as the seed's
    auto a = make_model("eval"), b = make_model("eval"), c = make_model("eval");
    auto fa = apply_fully_shard(*a, g, layer_units(mixed));
    auto fb = apply_fully_shard(*b, g, layer_units(mixed));
    auto fc = apply_fully_shard(*c, g, layer_units(mixed));
    auto first = nn::unique_named_parameters(*b).front();
    ASSERT_EQ(first.first, "embed_tokens.weight");
    {
      torch::NoGradGuard no_grad;
      std::lock_guard<std::mutex> lock(testing::rng_mutex());
      torch::nn::init::normal_(first.second);  // this rank's shard, in place
    }
    auto out_a = (*a)(ids), out_b = (*b)(ids), out_c = (*c)(ids);
    EXPECT_TRUE(out_a.equal(out_c));                         // the same model sharded the same way: the same output
    EXPECT_FALSE(out_a.equal(out_b));                        // the changed shard was gathered into b's forward
    EXPECT_EQ(first.second.size(0), g.rank == 0 ? 12 : 11);  // what changed was the shard: torch.chunk of 23 rows
  });
}

TEST(TransformerWithSharedParams, InPlaceParamChangeAfterFullyShardPersists) { param_change_persists(false); }
TEST(TransformerWithSharedParams, InPlaceParamChangeAfterFullyShardPersistsMixedPrecision) {
  param_change_persists(true);
}

TEST(TransformerWithSharedParams, BuffersAreWholeOnEveryRankAndNeverParameters) {
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_model("train");
    auto fs = apply_fully_shard(*m, g, layer_units(false));
    auto buffers = m->named_buffers();
    ASSERT_EQ(buffers.size(), 5u);
    EXPECT_TRUE(buffers["vocab_bias"].equal(torch::ones({16})));
    EXPECT_EQ(buffers["long_buffer"].scalar_type(), torch::kLong);
    EXPECT_EQ(buffers["bn.num_batches_tracked"].scalar_type(), torch::kLong);
    for (const auto& item : buffers) {
      EXPECT_FALSE(item.value().requires_grad()) << item.key();
      EXPECT_EQ(fs->shard_info(item.value()), nullptr) << item.key();
    }
    // Each rank's running statistics follow its own batches (as DDP without SyncBatchNorm): ranks see
    // different samples, so their statistics differ, and no collective makes them equal.
    auto ids = sample(g.rank);
    loss_of((*m)(ids), ids).backward();
    fs->reshard();
    auto mean = buffers["bn.running_mean"].clone();
    auto all = all_gather(g, mean.view({1, -1}), {1, 1});
    EXPECT_FALSE(all[0].equal(all[1]));
    EXPECT_EQ(buffers["bn.num_batches_tracked"].item<int64_t>(), 1);
  });
}

}  // namespace
}  // namespace composer::parallel

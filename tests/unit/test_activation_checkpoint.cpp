// activation_checkpointing on one device: losses and gradients bit-equal to
// the same model without it, with dropout on (so the generator's restore
// matters), one recompute per checkpointed unit and backward, `every`, and the
// activation bytes it saves, measured with a counting allocator.
#include <gtest/gtest.h>

#include <iostream>
#include <set>

#include "models/registry.h"
#include "parallelisms/activation_checkpoint.h"
#include "tests/unit/counting_allocator.h"

namespace composer::parallel {
namespace {

using Args = std::map<std::string, models::ArgValue>;

models::ModelPtr transformer(const Args& overrides) {
  const auto* spec = models::find_model("transformer");
  models::ModelArgs a;
  for (const auto& arg : spec->args) a.set(arg.name, arg.default_value);
  for (const auto& [k, v] : overrides) a.set(k, v);
  torch::manual_seed(7);
  auto m = spec->build(a);
  m->train();
  return m;
}

const Args kSmall{{"n_layers", int64_t{4}}, {"dropout_p", 0.1}};

torch::Tensor tokens(int64_t batch, int64_t seq, int64_t vocab, int64_t salt) {
  return torch::arange(batch * seq).mul(7).add(salt).remainder(vocab).view({batch, seq});
}

torch::Tensor loss_of(models::Model& m, int64_t step) {
  auto x = tokens(4, 16, 8, step);
  auto logits = m(x);
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1), tokens(4, 16, 8, step + 1).flatten());
}

struct Training {
  std::vector<double> losses;
  std::vector<torch::Tensor> grads;
  int64_t recomputes = 0, kept_taken = 0;
  std::vector<std::string> units;
};

// Two forwards and backwards (gradients accumulate): the second step's
// dropout masks come from the generator as the first backward left it.
Training train(const std::optional<ActivationCheckpointingConfig>& o, uint64_t data_seed = 11,
               const Args& model = kSmall) {
  auto m = transformer(model);
  std::unique_ptr<ActivationCheckpoint> ac;
  if (o) ac = apply_activation_checkpointing(*m, *o);
  torch::manual_seed(data_seed);
  Training r;
  for (int64_t step = 0; step < 2; ++step) {
    auto loss = loss_of(*m, step);
    loss.backward();
    r.losses.push_back(loss.item<double>());
  }
  for (auto& [n, p] : nn::unique_named_parameters(*m)) r.grads.push_back(p.grad().clone());
  if (ac) {
    r.recomputes = ac->recomputes();
    r.kept_taken = ac->kept_taken();
    r.units = ac->units();
  }
  return r;
}

void expect_bit_equal(const Training& a, const Training& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i;
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(a.grads[i].equal(b.grads[i])) << "parameter " << i;
}

TEST(ActivationCheckpoint, LossesAndGradientsAreBitEqualWithDropout) {
  Training plain = train(std::nullopt);
  Training ac = train(ActivationCheckpointingConfig{{"layers.*"}, 1});
  expect_bit_equal(plain, ac);
  EXPECT_EQ(ac.units, (std::vector<std::string>{"layers.0", "layers.1", "layers.2", "layers.3"}));
  EXPECT_EQ(ac.recomputes, 4 * 2);  // each checkpointed block once per backward
  // Dropout really draws from the generator: another seed trains otherwise,
  // so a recompute with other masks would not be bit-equal.
  EXPECT_NE(train(std::nullopt, 12).losses[0], plain.losses[0]);
}

TEST(ActivationCheckpoint, EveryNthUnit) {
  Training plain = train(std::nullopt);
  Training ac = train(ActivationCheckpointingConfig{{"layers"}, 2});  // a ModuleList: its children are the units
  expect_bit_equal(plain, ac);
  EXPECT_EQ(ac.units, (std::vector<std::string>{"layers.1", "layers.3"}));
  EXPECT_EQ(ac.recomputes, 2 * 2);
}

TEST(ActivationCheckpoint, ChecksUnits) {
  auto m = transformer(kSmall);
  EXPECT_EQ(check_checkpoint_units(*m, {{"layers.*.nope"}, 1}).value_or(""),
            "layers.*.nope: unit pattern matches no module of Transformer");
  EXPECT_NE(check_checkpoint_units(*m, {{"layers.*", "layers.*.attention"}, 1})
                .value_or("")
                .find("units layers.0 and layers.0.attention nest"),
            std::string::npos);
  EXPECT_NE(check_checkpoint_units(*m, {{"layers.*"}, 5}).value_or("").find("every 5 is more than the 4 matching"),
            std::string::npos);
  EXPECT_FALSE(check_checkpoint_units(*m, {{"layers.*"}, 4}).has_value());
}

// The bytes a forward leaves alive for backward (its saved activations and
// the loss) and the peak over forward and backward, above what lived before.
struct Memory {
  int64_t kept = 0, peak = 0;
};

Memory measure(const std::optional<ActivationCheckpointingConfig>& o, double dropout) {
  auto& alloc = testing::CountingAllocator::installed();
  auto m = transformer({{"n_layers", int64_t{4}},
                        {"dim", int64_t{64}},
                        {"n_heads", int64_t{4}},
                        {"max_seq_len", int64_t{64}},
                        {"vocab_size", int64_t{32}},
                        {"dropout_p", dropout}});
  std::unique_ptr<ActivationCheckpoint> ac;
  if (o) ac = apply_activation_checkpointing(*m, *o);
  auto x = tokens(8, 64, 32, 0);
  auto target = tokens(8, 64, 32, 1).flatten();
  torch::manual_seed(11);
  Memory mem;
  const int64_t base = alloc.live();
  alloc.reset_peak();
  {
    auto loss = torch::nn::functional::cross_entropy((*m)(x).flatten(0, 1), target);
    mem.kept = alloc.live() - base;
    loss.backward();
  }
  mem.peak = alloc.peak() - base;
  return mem;
}

TEST(ActivationCheckpoint, KeepsFewerActivationBytesMeasured) {
  Memory plain = measure(std::nullopt, 0.1), ac = measure(ActivationCheckpointingConfig{{"layers.*"}, 1}, 0.1);
  std::cout << "transformer 4 x dim 64, batch 8 x seq 64: kept after forward " << plain.kept << " bytes without, "
            << ac.kept << " with activation checkpointing; peak over forward and backward " << plain.peak << " vs "
            << ac.peak << "\n";
  // Every block keeps only its input (8 x 64 x 64 floats) and a generator
  // state instead of its attention scores, probabilities, masks and MLP
  // activations: less than half.
  EXPECT_LT(2 * ac.kept, plain.kept);
  EXPECT_LT(ac.peak, plain.peak);
}

ActivationCheckpointingConfig op_mode(std::vector<std::string> ops, int64_t ops_every = 1) {
  ActivationCheckpointingConfig c{{"layers.*"}, 1};
  c.mode = CheckpointMode::kOp;
  c.ops = std::move(ops);
  c.ops_every = ops_every;
  return c;
}

// Without dropout attention runs LibTorch's CPU flash kernel, whose output op mode keeps; the
// Linear layers' outputs are kept too, and their backward is the mm backward autograd runs.
Training train_without_dropout(const std::optional<ActivationCheckpointingConfig>& o) {
  return train(o, 11, {{"n_layers", int64_t{4}}, {"dropout_p", 0.0}});
}

TEST(ActivationCheckpoint, OpModeIsBitEqualToNoCheckpointing) {
  Training plain = train_without_dropout(std::nullopt);
  // A block's kept-kind ops in forward order: wq, wk, wv, attention, wo, w1, w2. Per block and
  // backward the recompute takes back: all 7; the 6 Linear; attention; every 2nd (wk, attention, w1);
  // every 3rd (wv, w1).
  const std::pair<ActivationCheckpointingConfig, int64_t> cases[] = {
      {op_mode({"linear", "attention"}), 7}, {op_mode({"linear"}), 6}, {op_mode({"attention"}), 1},
      {op_mode({"linear", "attention"}, 2), 3}, {op_mode({"linear", "attention"}, 3), 2}};
  for (const auto& [c, per_block] : cases) {
    SCOPED_TRACE("ops " + std::to_string(c.kept_ops()) + " every " + std::to_string(c.ops_every));
    Training ac = train_without_dropout(c);
    expect_bit_equal(plain, ac);
    EXPECT_EQ(ac.recomputes, 4 * 2);
    EXPECT_EQ(ac.kept_taken, 4 * 2 * per_block);
  }
  // Full mode keeps nothing inside a unit.
  EXPECT_EQ(train_without_dropout(ActivationCheckpointingConfig{{"layers.*"}, 1}).kept_taken, 0);
}

TEST(ActivationCheckpoint, OpModeOptionsAreChecked) {
  std::set<std::string> given{"units", "ops"};
  ActivationCheckpointingConfig full{{"layers.*"}, 1};
  auto e = full.check(given);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->key, "ops");
  EXPECT_NE(e->message.find("add mode: op"), std::string::npos) << e->message;
  auto bad = op_mode({"linear", "softmax"});
  e = bad.check({"units", "mode", "ops"});
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->message, "unknown op 'softmax'; valid ops: linear, attention");
  EXPECT_FALSE(op_mode({"attention"}).check({"units", "mode", "ops"}).has_value());
}

// Without dropout attention runs the flash kernel, whose output op mode keeps.
Memory measure_kept(const std::optional<ActivationCheckpointingConfig>& o) { return measure(o, 0.0); }

TEST(ActivationCheckpoint, OpModeKeepsBetweenFullAndNoneMeasured) {
  const Memory plain = measure_kept(std::nullopt), full = measure_kept(ActivationCheckpointingConfig{{"layers.*"}, 1}),
               op = measure_kept(op_mode({"linear", "attention"})),
               half = measure_kept(op_mode({"linear", "attention"}, 2));
  std::cout << "transformer 4 x dim 64, batch 8 x seq 64, kept after forward: none " << plain.kept << ", op " << op.kept
            << ", op every 2nd " << half.kept << ", full " << full.kept << " bytes; peak " << plain.peak << ", "
            << op.peak << ", " << half.peak << ", " << full.peak << "\n";
  // A block's Linear outputs (q, k, v in one in_proj of 3 x 64, out_proj 64, the MLP's 4 x 64 and 64 wide)
  // and attention's output and log-sum-exp, per token; what op mode adds to full's inputs.
  const int64_t tokens_ = 8 * 64, per_block = tokens_ * (3 * 64 + 64 + 4 * 64 + 64 + 64) * 4 + 8 * 4 * 64 * 4;
  EXPECT_EQ(op.kept - full.kept, 4 * per_block);
  EXPECT_LT(op.kept, plain.kept);
  EXPECT_LT(full.kept, half.kept);
  EXPECT_LT(half.kept, op.kept);
}

}  // namespace
}  // namespace composer::parallel

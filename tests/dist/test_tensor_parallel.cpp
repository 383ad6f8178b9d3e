// tensor_parallel on real Gloo groups: outputs and full gradients equal the
// single-device model's, and the communication matches the closed-form
// counts (docs/scenarios.md 2.A.3: MLPStack at tp 4 issues 3 all-reduces in
// forward and 2 in backward, and nothing else).
#include <gtest/gtest.h>

#include <set>

#include "models/registry.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/tensor_parallel.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

models::ModelPtr make(const std::string& name, const std::map<std::string, models::ArgValue>& overrides = {}) {
  return testing::seeded_model(name, 42, overrides);
}

models::TpPlan plan_of(const std::string& name, bool sp = false) {
  const auto* spec = models::find_model(name);
  models::ModelArgs a;
  for (const auto& arg : spec->args) a.set(arg.name, arg.default_value);
  return spec->tp_plan(a, sp);
}

// The full gradient of `p` on every tp rank.
torch::Tensor full_grad(TensorParallel& tp, Group& g, const torch::Tensor& p) {
  const TpShard* s = tp.shard_of(p);
  if (!s) return p.grad();
  return gather_dim(g, p.grad(), s->dim, s->global_size);
}

TEST(FqnMatch, StarStaysInsideASegment) {
  EXPECT_TRUE(models::fqn_matches("layers.*.attention.wq", "layers.12.attention.wq"));
  EXPECT_FALSE(models::fqn_matches("layers.*.wq", "layers.1.attention.wq"));
  EXPECT_TRUE(models::fqn_matches("*.in_proj", "2.in_proj"));
  EXPECT_FALSE(models::fqn_matches("net1", "net12"));
  EXPECT_TRUE(models::fqn_matches("net*", "net12"));
}

TEST(FqnMatch, DoubleStarCrossesSegments) {
  EXPECT_TRUE(models::fqn_matches("**", "module"));
  EXPECT_TRUE(models::fqn_matches("**", "layers.0.attention.wq"));
  EXPECT_TRUE(models::fqn_matches("layers.**.wq", "layers.1.attention.wq"));
  EXPECT_FALSE(models::fqn_matches("layers.**.wq", "layers.1.attention.wk"));
  EXPECT_TRUE(models::fqn_matches("**.bias", "a.b.bias"));
  EXPECT_FALSE(models::fqn_matches("**.bias", "bias"));
  EXPECT_FALSE(models::fqn_matches("layers.*.wq", "layers.1.attention.wq"));
}

TEST(TpPlanCheck, NamesThePatternAndTheProblem) {
  auto m = make("simple_model");
  EXPECT_FALSE(check_tp_plan(*m, plan_of("simple_model")).has_value());
  auto miss = check_tp_plan(*m, {models::colwise("net9")});
  ASSERT_TRUE(miss.has_value());
  EXPECT_EQ(*miss, "net9: colwise pattern matches no module of SimpleModel");
  auto t = make("transformer");
  auto wrong = check_tp_plan(*t, {models::colwise("norm")});
  ASSERT_TRUE(wrong.has_value());
  EXPECT_EQ(*wrong, "norm: colwise needs a Linear, not a LayerNorm (module norm)");
  auto sp = check_tp_plan(*t, {models::sequence_parallel("layers.*.attention.wq")});
  EXPECT_NE(sp->find("sequence_parallel needs a LayerNorm or RMSNorm, not a Linear"), std::string::npos);
}

TEST(TensorParallel, ColwiseThenRowwiseIssuesOneAllReduceEachWay) {
  testing::run_ranks({"tp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("tp");
    auto ref = make("mlp_module");
    auto m = make("mlp_module");
    Placements pl;
    auto tp = apply_tensor_parallel(*m, g, plan_of("mlp_module"), pl);
    auto x = torch::linspace(-2, 2, 40).view({4, 10}).sin();
    auto xr = x.clone().requires_grad_(true), xt = x.clone().requires_grad_(true);
    auto yr = (*ref)(xr);
    g.counter->reset();
    auto y = (*m)(xt);
    EXPECT_EQ(g.counter->get("all_reduce").calls, 1);
    EXPECT_EQ(g.counter->total().calls, 1);
    EXPECT_TRUE(torch::allclose(y, yr, 1e-5, 1e-6));
    yr.pow(2).sum().backward();
    g.counter->reset();
    y.pow(2).sum().backward();
    EXPECT_EQ(g.counter->get("all_reduce").calls, 1);
    EXPECT_EQ(g.counter->total().calls, 1);
    EXPECT_TRUE(torch::allclose(xt.grad(), xr.grad(), 1e-5, 1e-6));
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      auto rp = ref->named_parameters()[n];
      auto grad_full = full_grad(*tp, g, p);
      EXPECT_TRUE(torch::allclose(grad_full, rp.grad(), 1e-5, 1e-6)) << n;
      EXPECT_TRUE(torch::allclose(gather_full(*pl.find(p), p), rp, 0, 0)) << n;
    }
  });
}

TEST(TensorParallel, MLPStackAtTp4MatchesTheScenarioCounts) {
  testing::run_ranks({"tp"}, {4}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("tp");
    auto ref = make("mlp_stack");
    auto m = make("mlp_stack");
    Placements pl;
    apply_tensor_parallel(*m, g, plan_of("mlp_stack"), pl);
    auto x = torch::linspace(-2, 2, 64).view({4, 16}).cos();
    g.counter->reset();
    auto y = (*m)(x);
    EXPECT_EQ(g.counter->get("all_reduce").calls, 3);
    EXPECT_EQ(g.counter->total().calls, 3);  // no all_gather, no reduce_scatter
    EXPECT_TRUE(torch::allclose(y, (*ref)(x), 1e-5, 1e-6));
    g.counter->reset();
    y.sum().backward();
    EXPECT_EQ(g.counter->get("all_reduce").calls, 2);  // the first MLP's input needs no gradient
    EXPECT_EQ(g.counter->total().calls, 2);
  });
}

// The names of the autograd nodes behind `t`.
std::set<std::string> graph_nodes(const torch::Tensor& t) {
  std::set<std::string> names;
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!todo.empty()) {
    auto* n = todo.back();
    todo.pop_back();
    if (!n || !seen.insert(n).second) continue;
    names.insert(n->name());
    for (const auto& e : n->next_edges()) todo.push_back(e.function.get());
  }
  return names;
}

bool has_node(const std::set<std::string>& names, const std::string& part) {
  for (const auto& n : names) {
    if (n.find(part) != std::string::npos) return true;
  }
  return false;
}

// At tp 2 and 4 (the fused rings' one step and several): the colwise Linears
// with a sequence-sharded input (feed_forward.w1, output) gather it fused
// with their matmul, the rowwise ones (wo, w2) reduce-scatter fused with it.
TEST(TensorParallel, SequenceParallelTransformerMatchesOneDevice) {
  for (int64_t tp : {2, 4}) {
    testing::run_ranks({"tp"}, {tp}, [](DeviceMesh& mesh) {
      auto& g = mesh.group("tp");
      std::map<std::string, models::ArgValue> args{{"dropout_p", 0.0}, {"n_layers", int64_t{2}}};
      auto ref = make("transformer", args);
      auto m = make("transformer", args);
      Placements pl;
      auto tp = apply_tensor_parallel(*m, g, plan_of("transformer", /*sp=*/true), pl);
      // The sequence-parallel norms' gradients are Partial over tp: the
      // gradient synchronisation sums them, in one bucket.
      auto w = m->named_parameters()["layers.0.attention_norm.weight"];
      EXPECT_EQ(pl.find(w)->str(), "[16] tp:R/P(sum)");
      std::vector<torch::Tensor> params;
      for (auto& [n, p] : nn::unique_named_parameters(*m)) params.push_back(p);
      GradSync sync(params, pl, {});
      EXPECT_EQ(sync.num_buckets(), 1u);
      auto tokens = torch::arange(32, torch::kLong).remainder(8).view({2, 16});
      auto y = (*m)(tokens), yr = (*ref)(tokens);
      EXPECT_TRUE(torch::allclose(y, yr, 1e-5, 1e-5));
      const auto nodes = graph_nodes(y);
      EXPECT_TRUE(has_node(nodes, "GatherLinearFn"));
      EXPECT_TRUE(has_node(nodes, "LinearReduceScatterFn"));
      g.counter->reset();
      y.pow(2).sum().backward();
      sync.finish();
      // Backward all-reduces nothing but the norms' gradient bucket: each
      // gathered block input's partial gradients (wq, wk, wv) are
      // reduce-scattered once by the gather, not all-reduced per Linear.
      EXPECT_EQ(g.counter->get("all_reduce").calls, 1);
      EXPECT_EQ(g.counter->get("all_reduce").bytes, sync.buffer_bytes());
      // Per layer: the attention's and w1's input gradients reduce-scattered, wo's and w2's output
      // gradients gathered; then the output Linear's input gradient reduce-scattered, and the two
      // embeddings' output gradients gathered.
      EXPECT_EQ(g.counter->get("reduce_scatter").calls, 2 * 2 + 1);
      EXPECT_EQ(g.counter->get("all_gather").calls, 2 * 2 + 2);
      yr.pow(2).sum().backward();
      for (auto& [n, p] : nn::unique_named_parameters(*m)) {
        auto rp = ref->named_parameters()[n];
        auto grad_full = full_grad(*tp, g, p);
        // float32 sums in another order: tolerance relative to the gradient's scale.
        const double scale = 1 + rp.grad().abs().max().item<double>();
        EXPECT_TRUE(torch::allclose(grad_full, rp.grad(), 1e-4, 1e-6 * scale))
            << n << " max abs diff " << (grad_full - rp.grad()).abs().max().item<double>() << " of max "
            << rp.grad().abs().max().item<double>() << " at tp " << g.size;
      }
    });
  }
}

// Loss parallel: cross entropy of vocabulary-sharded logits equals the whole
// logits' cross entropy, and so do the logits' gradients, at tp 2 and at tp 4
// over a vocabulary of 5 (pieces 2, 2, 1 and an empty one).
TEST(TensorParallel, VocabParallelCrossEntropyEqualsTheWholeLogits) {
  for (int64_t tp : {2, 4}) {
    const int64_t vocab = tp == 2 ? 8 : 5, rows = 6;
    auto logits = torch::linspace(-3, 3, rows * vocab).view({rows, vocab}).mul(torch::arange(rows * vocab).view({rows, vocab}).cos());
    auto targets = torch::arange(rows, torch::kLong).mul(3).remainder(vocab);
    auto whole = logits.clone().requires_grad_(true);
    auto expect = torch::cross_entropy_loss(whole, targets);
    expect.backward();
    testing::run_ranks({"tp"}, {tp}, [&](DeviceMesh& mesh) {
      auto& g = mesh.group("tp");
      const auto sizes = chunk_sizes(vocab, g.size);
      int64_t start = 0;
      for (int r = 0; r < g.rank; ++r) start += sizes[r];
      auto local = logits.narrow(1, start, sizes[g.rank]).clone().requires_grad_(true);
      g.counter->reset();
      auto loss = vocab_parallel_cross_entropy({&g, vocab}, local, targets);
      EXPECT_EQ(g.counter->get("all_reduce").calls, 2);  // the max, then the two sums together
      EXPECT_NEAR(loss.item<double>(), expect.item<double>(), 1e-6);
      loss.backward();
      EXPECT_EQ(g.counter->get("all_reduce").calls, 2);  // the gradient needs none
      EXPECT_TRUE(torch::allclose(local.grad(), whole.grad().narrow(1, start, sizes[g.rank]), 1e-5, 1e-7))
          << "tp " << tp << " rank " << g.rank;
    });
  }
}

}  // namespace
}  // namespace composer::parallel

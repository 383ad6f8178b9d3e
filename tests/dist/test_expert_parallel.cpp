// expert_parallel on real Gloo groups: one mixture-of-experts block's dispatch
// and combine against the same block on one process (every rank's tokens
// through every expert), for uneven counts, for experts and a rank that
// receive no token, and the all-to-all's bytes against the counts.
#include <gtest/gtest.h>

#include "models/moe.h"
#include "parallelisms/parallelize.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

constexpr int64_t kDim = 16, kExperts = 4, kTopK = 2;

models::ModelPtr moe_llama() {
  return testing::seeded_model("llama", 11, {{"dim", kDim}, {"n_layers", int64_t{1}}, {"n_heads", int64_t{2}},
                                             {"vocab_size", int64_t{32}}, {"multiple_of", int64_t{8}},
                                             {"max_seq_len", int64_t{16}}, {"n_experts", kExperts},
                                             {"top_k", kTopK}, {"moe_hidden_dim", int64_t{8}},
                                             {"route_norm", true}});
}

models::MoE& block_of(models::Model& m) {
  return *dynamic_cast<models::MoE*>(m.named_modules()["layers.0.feed_forward"].get());
}

// Rank s's hidden states [2, 5, dim]; `skewed` makes every token choose
// experts 0 and 1 (with the router set by skew()).
torch::Tensor input_of(int s, bool skewed) {
  auto x = torch::linspace(-1, 1, 2 * 5 * kDim).view({2, 5, kDim}).mul(s + 1.3).sin();
  if (skewed) x.select(-1, 0).abs_().add_(1);
  return x;
}

// Experts 0 and 1 score high on feature 0, 2 and 3 low.
void skew(models::MoE& moe) {
  torch::NoGradGuard no_grad;
  auto& w = moe.router->weight;
  w.zero_();
  w[0][0] = 5;
  w[1][0] = 4;
  w[2][0] = -4;
  w[3][0] = -5;
}

// The output weights of rank s's loss (y * c).sum().
torch::Tensor weights_of(int s) { return torch::linspace(0.5, 2, 2 * 5 * kDim).view({2, 5, kDim}).mul(s + 1).cos(); }

void check_dispatch(int ep, bool skewed) {
  testing::run_ranks({"ep"}, {ep}, [ep, skewed](DeviceMesh& mesh) {
    Group& g = mesh.group("ep");
    // One process's block: every rank's tokens through all the experts.
    auto ref = moe_llama();
    models::MoE& whole = block_of(*ref);
    if (skewed) skew(whole);
    std::vector<torch::Tensor> inputs, outputs;
    std::vector<std::vector<int64_t>> counts;
    auto total = torch::zeros({}, torch::kFloat);
    for (int s = 0; s < ep; ++s) {
      inputs.push_back(input_of(s, skewed).requires_grad_());
      outputs.push_back(whole(inputs.back()));
      counts.push_back(whole.last_counts);
      total = total + (outputs.back() * weights_of(s)).sum();
    }
    total.backward();

    auto m = moe_llama();
    ParallelizeOptions o;
    o.mesh = &mesh;
    o.world = &mesh.world();
    o.data_parallel = &g;
    auto par = parallelize(*m, {ExpertParallelConfig{}}, o);
    par.derive_grad_sync();
    models::MoE& moe = block_of(*m);
    if (skewed) skew(moe);
    const int64_t e = kExperts / ep;
    ASSERT_EQ(moe.experts->w1.size(0), e);
    auto x = input_of(g.rank, skewed).requires_grad_();
    // The rows this rank's experts receive from every rank, by the one-process routing.
    int64_t received = 0;
    for (int s = 0; s < ep; ++s) {
      for (int64_t j = g.rank * e; j < (g.rank + 1) * e; ++j) received += counts[s][j];
    }
    g.counter->reset();
    auto y = moe(x);
    // Forward: the counts (n_experts int64), this rank's rows out, and its
    // experts' outputs for the rows it received back to their ranks.
    const int64_t rows = x.numel() / kDim * kTopK, row_bytes = kDim * 4;
    EXPECT_EQ(g.counter->get("all_to_all").calls, 3);
    EXPECT_EQ(g.counter->get("all_to_all").bytes, kExperts * 8 + (rows + received) * row_bytes);
    EXPECT_TRUE(torch::allclose(y, outputs[g.rank], 1e-5, 1e-6)) << (y - outputs[g.rank]).abs().max();
    // Backward: each rank's loss is ep x its share, as the trainer's.
    g.counter->reset();
    ((y * weights_of(g.rank)).sum() * ep).backward();
    // Backward: the gradients of this rank's rows out, those of the received rows back.
    EXPECT_EQ(g.counter->get("all_to_all").calls, 2);
    par.finish_grad_sync();  // the step's reductions, then the experts' 1/ep
    EXPECT_EQ(g.counter->get("all_to_all").bytes, (rows + received) * row_bytes);
    if (skewed) {
      EXPECT_EQ(received, g.rank == 0 ? ep * rows : 0);  // experts 2 and 3 (ep 2: rank 1's) get none
    }
    auto x_grad = inputs[g.rank].grad() * ep;  // ep x this rank's share
    EXPECT_TRUE(torch::allclose(x.grad(), x_grad, 1e-5, 1e-6)) << (x.grad() - x_grad).abs().max();
    // The local experts' gradients: the sum over every rank's tokens, averaged
    // over ep by the gradient synchronisation's factor.
    for (auto [local, full] : {std::pair{&moe.experts->w1, &whole.experts->w1}, {&moe.experts->w2, &whole.experts->w2},
                               {&moe.experts->w3, &whole.experts->w3}}) {
      auto expect = full->grad().narrow(0, g.rank * e, e);
      // Defined even where no row arrived (zeros), as one device's: the
      // optimizer steps such an expert by its momentum and decay.
      ASSERT_TRUE(local->grad().defined());
      EXPECT_TRUE(torch::allclose(local->grad(), expect, 1e-5, 1e-6)) << (local->grad() - expect).abs().max();
    }
  });
}

TEST(ExpertParallel, DispatchAndCombineEqualOneProcessForUnevenCounts) {
  check_dispatch(2, false);
  check_dispatch(4, false);
}

TEST(ExpertParallel, ExpertsAndARankThatReceiveNoTokenGetZeroGradients) { check_dispatch(2, true); }

TEST(ExpertParallel, ExpertWeightsAreShardedOverEpAndTheRestReplicated) {
  testing::run_ranks({"ep"}, {2}, [](DeviceMesh& mesh) {
    auto m = moe_llama();
    ParallelizeOptions o;
    o.mesh = &mesh;
    o.world = &mesh.world();
    o.data_parallel = &mesh.group("ep");
    auto par = parallelize(*m, {ExpertParallelConfig{}}, o);
    for (auto& item : m->named_parameters()) {
      const std::string& name = item.key();
      const ShardSpec* spec = par.placements->find(item.value());
      ASSERT_NE(spec, nullptr) << name;
      const bool expert = name.find(".experts.") != std::string::npos;
      EXPECT_EQ(spec->str().find(expert ? "ep:S(0)" : "ep:R") != std::string::npos, true) << name << " " << spec->str();
    }
  });
}

}  // namespace
}  // namespace composer::parallel

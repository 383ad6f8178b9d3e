// fully_shard on real Gloo groups: per unit and pass one all-gather and one
// reduce-scatter, unsharded storage really freed after forward, gradients
// equal to the single-device average, 1-way sharding issues nothing, and the
// extensions: prefetch, mixed precision, all-gather extensions, HSDP, the
// shard-dim rule and 2-D with tensor parallel.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/tensor_parallel.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

// mlp_dim 17: 51 and 68 rows, uneven over the ranks.
models::ModelPtr make_stack() { return testing::seeded_model("mlp_stack", 3, {{"mlp_dim", int64_t{17}}}); }

torch::Tensor input_of(int rank) { return torch::linspace(-1, 1, 4 * 17).view({4, 17}).mul(rank + 1).sin(); }

void run_counts(bool reshard) {
  testing::run_ranks({"dp"}, {2}, [reshard](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, reshard});
    EXPECT_EQ(fs->num_units(), 3u);  // the root owns no parameter of its own
    g.counter->reset();
    auto y = (*m)(input_of(g.rank));
    EXPECT_EQ(g.counter->get("all_gather").calls, 3);
    EXPECT_EQ(g.counter->total().calls, 3);
    g.counter->reset();
    y.sum().backward();
    EXPECT_EQ(g.counter->get("reduce_scatter").calls, 3);
    EXPECT_EQ(g.counter->get("all_gather").calls, reshard ? 3 : 0);  // re-gathered before each unit's backward
    EXPECT_EQ(g.counter->total().calls, reshard ? 6 : 3);
  });
}

TEST(FullyShard, OneAllGatherAndOneReduceScatterPerUnitPerPass) { run_counts(true); }
TEST(FullyShard, WithoutReshardBackwardGathersNothing) { run_counts(false); }

TEST(FullyShard, GradientsAreTheAverageOverRanksAndShardsAreTorchChunks) {
  auto ref = make_stack();
  for (int r = 0; r < 2; ++r) (*ref)(input_of(r)).sum().backward();
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    Placements pl;
    FullyShardOptions o{{"*"}, true};
    o.placements = &pl;
    auto fs = apply_fully_shard(*m, g, o);
    (*m)(input_of(g.rank)).sum().backward();
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      auto rp = ref->named_parameters()[n];
      EXPECT_EQ(p.size(0), rp.chunk(2, 0)[g.rank].size(0)) << n;
      EXPECT_EQ(pl.find(p)->local_shape(), p.sizes().vec()) << n;
      auto expect = rp.grad().chunk(2, 0)[g.rank] / 2;
      EXPECT_TRUE(torch::allclose(p.grad(), expect, 1e-5, 1e-6)) << n;
      EXPECT_TRUE(gather_full(*pl.find(p), p).equal(rp.detach())) << n;
    }
  });
}

TEST(FullyShard, AccumulationReduceScattersOnceAfterTheLastMicrobatch) {
  auto ref = make_stack();
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < 2; ++k) (*ref)(input_of(r) * (k + 1)).sum().backward();
  }
  testing::run_ranks({"dp"}, {2}, [&](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, true});
    g.counter->reset();
    for (int k = 0; k < 2; ++k) {
      fs->set_requires_sync(k == 1);
      (*m)(input_of(g.rank) * (k + 1)).sum().backward();
      fs->reshard();
      EXPECT_EQ(g.counter->get("reduce_scatter").calls, k == 0 ? 0 : 3);
    }
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      auto expect = ref->named_parameters()[n].grad().chunk(2, 0)[g.rank] / 2;
      EXPECT_TRUE(torch::allclose(p.grad(), expect, 1e-5, 1e-6)) << n;
    }
  });
}

TEST(FullyShard, ReshardAfterForwardFreesTheUnshardedStorage) {
  testing::run_ranks({"dp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, true});
    auto x = input_of(g.rank);
    auto* first = dynamic_cast<nn::Module*>(m->named_modules()["0.in_proj"].get());
    auto weight = m->named_parameters()["0.in_proj.weight"];
    auto y = (*m)(x);
    const auto& full = first->param(weight);
    EXPECT_EQ(full.size(0), 51);                       // the view the layer computed with was full
    EXPECT_EQ(full.storage().nbytes(), 0u);            // and its storage is released after forward
    y.sum().backward();
    EXPECT_TRUE(weight.grad().defined());
  });
}

// reshard_after_forward: 2 on dp 4 (FSDP2's integer form): forward gathers
// over all 4 ranks, each rank keeps the gathered rows of 2 of them, and the
// backward re-gathers over its pair only, twice the bytes of a forward
// gather's input from each rank, never over dp. The values are byte copies, so
// the gradients equal whole-group resharding's exactly, on a second step too
// (the kept rows are those of the current shards, not the last step's).
TEST(FullyShard, ReshardingToAPairReGathersOverThePairAndTrainsIdentically) {
  auto grads_of = [](DeviceMesh& mesh, bool to_pair) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    FullyShardOptions o{{"*"}, true};
    Group* pair = nullptr;
    if (to_pair) {
      const int base = g.rank / 2 * 2;
      pair = o.post_forward = &mesh.subgroup("dp", {base, base + 1});
    }
    auto fs = apply_fully_shard(*m, g, o);
    std::vector<torch::Tensor> out;
    for (int step = 0; step < 2; ++step) {
      g.counter->reset();
      if (pair) pair->counter->reset();
      for (int k = 0; k < 2; ++k) {  // two microbatches: the second forward keeps nothing new
        fs->set_requires_sync(k == 1);
        auto y = (*m)(input_of(g.rank) * (k + 1));
        const auto forward = g.counter->get("all_gather");
        if (k == 0) {
          EXPECT_EQ(forward.calls, 3);
        }
        y.sum().backward();
        EXPECT_EQ(g.counter->get("all_gather").calls, pair ? 3 : 3 * (k + 2));  // whole group: re-gathered over dp
        if (pair) {
          EXPECT_EQ(pair->counter->get("all_gather").calls, 3 * (k + 1));  // one per unit and backward
          EXPECT_EQ(pair->counter->get("all_gather").bytes, 2 * (k + 1) * forward.bytes);
          EXPECT_EQ(pair->counter->total().calls, 3 * (k + 1));
        }
      }
      fs->reshard();
      torch::NoGradGuard no_grad;
      for (auto& p : m->parameters()) {
        out.push_back(p.grad().clone());
        p.sub_(p.grad());  // the next step gathers the new shards
        p.mutable_grad() = torch::Tensor();
      }
    }
    return out;
  };
  testing::run_ranks({"dp"}, {4}, [&](DeviceMesh& mesh) {
    auto whole = grads_of(mesh, false);
    auto pair = grads_of(mesh, true);
    ASSERT_EQ(whole.size(), pair.size());
    for (size_t i = 0; i < whole.size(); ++i) EXPECT_TRUE(whole[i].equal(pair[i])) << i;
  });
}

TEST(FullyShard, OneWayShardingIssuesNoCollective) {
  testing::run_ranks({"dp", "tp"}, {1, 2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto fs = apply_fully_shard(*m, g, {{"*"}, true});
    (*m)(input_of(0)).sum().backward();
    EXPECT_EQ(g.counter->total().calls, 0);
  });
}


// The default extension without its one-rank shortcut: every gather goes
// through the send buffer and the collective's path, as on a larger group.
class ThroughBuffers : public AllGatherExtension {
 public:
  std::string name() const override { return "through_buffers"; }
  std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, const ShardInfo& info,
                                            c10::ScalarType dtype) const override {
    return default_all_gather().pre_all_gather(shard, info, dtype);
  }
  torch::Tensor post_all_gather(const std::vector<torch::Tensor>& gathered, const ShardInfo& info,
                                c10::ScalarType dtype, const torch::Tensor& out) const override {
    return default_all_gather().post_all_gather(gathered, info, dtype, out);
  }
};

TEST(FullyShard, OneRankCastsEachShardInPlaceAndTrainsBitForBitAsThroughTheBuffers) {
  testing::run_ranks({"dp"}, {1}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    std::vector<std::map<std::string, torch::Tensor>> grads;
    std::vector<torch::Tensor> outputs;
    std::vector<int64_t> pooled;
    for (bool alone : {true, false}) {
      auto m = make_stack();
      FullyShardOptions o{{"*"}, true};
      o.param_dtype = torch::kBFloat16;
      o.reduce_dtype = torch::kFloat;
      if (!alone) o.extension = std::make_shared<ThroughBuffers>();
      auto fs = apply_fully_shard(*m, g, o);
      auto y = (*m)(input_of(0));
      y.sum().backward();  // the backward re-gathers every unit (reshard after forward)
      fs->reshard();
      outputs.push_back(y);
      grads.emplace_back();
      for (auto& [n, p] : nn::unique_named_parameters(*m)) {
        EXPECT_EQ(p.grad().scalar_type(), torch::kFloat) << n;
        grads.back()[n] = p.grad();
      }
      pooled.push_back(fs->pooled_bytes());
    }
    EXPECT_EQ(g.counter->total().calls, 0);
    EXPECT_TRUE(outputs[0].equal(outputs[1]));
    for (auto& [n, grad] : grads[0]) EXPECT_TRUE(grad.equal(grads[1][n])) << n;
    // Only the unsharded buffer is pooled: no send buffer (bf16) and no
    // gradient buffer (float32) beside it.
    EXPECT_LT(pooled[0], pooled[1]);
    int64_t unsharded = 0;
    for (auto& [n, grad] : grads[0]) unsharded += grad.numel() * 2;
    EXPECT_GE(pooled[0], unsharded / 3);  // at least the largest unit's bf16 parameters
    EXPECT_GE(pooled[1], pooled[0] + unsharded / 3 + unsharded / 3 * 2);
  });
}

// The average over `ranks` inputs of the single-device gradients.
std::map<std::string, torch::Tensor> reference_grads(int ranks) {
  auto ref = make_stack();
  for (int r = 0; r < ranks; ++r) (*ref)(input_of(r)).sum().backward();
  std::map<std::string, torch::Tensor> out;
  for (auto& [n, p] : nn::unique_named_parameters(*ref)) out[n] = p.grad() / ranks;
  return out;
}

TEST(FullyShard, PrefetchIssuesTheNextUnitsAllGatherBeforeItComputes) {
  for (bool prefetch : {true, false}) {
    testing::run_ranks({"dp"}, {2}, [prefetch](DeviceMesh& mesh) {
      auto& g = mesh.group("dp");
      auto m = make_stack();
      FullyShardOptions o{{"*"}, true};
      o.prefetch = prefetch;
      auto fs = apply_fully_shard(*m, g, o);
      std::vector<int64_t> seen;  // all-gathers issued when each unit starts computing
      for (const char* unit : {"0", "1", "2"}) {
        dynamic_cast<nn::Module*>(m->named_modules()[unit].get())->add_pre_hook([&](nn::Module&, torch::Tensor x) {
          seen.push_back(g.counter->get("all_gather").calls);
          return x;
        });
      }
      for (int step = 0; step < 2; ++step) {  // the first step records the order
        seen.clear();
        g.counter->reset();
        (*m)(input_of(g.rank)).sum().backward();
        fs->reshard();
      }
      // With prefetch, unit i computes after i+2 gathers (its own and the next's).
      EXPECT_EQ(seen, prefetch ? std::vector<int64_t>({2, 3, 3}) : std::vector<int64_t>({1, 2, 3}));
      EXPECT_EQ(g.counter->get("all_gather").calls, 6);  // still one per unit and pass
      EXPECT_EQ(g.counter->get("reduce_scatter").calls, 3);
    });
  }
}

TEST(FullyShard, MixedPrecisionComputesInBf16AndKeepsFloat32Shards) {
  testing::run_ranks({"dp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    FullyShardOptions o{{"*"}, true};
    o.param_dtype = torch::kBFloat16;
    o.reduce_dtype = torch::kFloat;
    auto fs = apply_fully_shard(*m, g, o);
    auto* first = dynamic_cast<nn::Module*>(m->named_modules()["0.in_proj"].get());
    auto weight = m->named_parameters()["0.in_proj.weight"];
    torch::ScalarType computed = torch::kFloat;
    first->add_pre_hook([&](nn::Module& mod, torch::Tensor x) {
      computed = mod.param(weight).scalar_type();
      return x;
    });
    g.counter->reset();
    auto y = (*m)(input_of(g.rank));
    EXPECT_EQ(computed, torch::kBFloat16);
    EXPECT_EQ(y.scalar_type(), torch::kFloat);  // outputs come back in the parameters' dtype
    // bf16 all-gathers move half the bytes: every unit's padded shards, 2 bytes each.
    int64_t padded = 0;
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      const ShardInfo& info = *fs->shard_info(p);
      int64_t numel = 1;
      for (auto d : info.padded_shape()) numel *= d;
      padded += numel;
    }
    EXPECT_LE(g.counter->get("all_gather").bytes, padded * 2 + 3 * 4 * 16);  // plus per-slot alignment
    y.sum().backward();
    auto ref = reference_grads(2);
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat) << n;
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat) << n;
      auto expect = ref[n].chunk(2, 0)[g.rank];
      EXPECT_TRUE(torch::allclose(p.grad(), expect, 5e-2, 5e-2)) << n;  // bf16 compute
    }
  });
}

// An extension with two all-gather inputs per parameter (as TwoTensor has):
// the shard and its negation; the unsharded value is their half-difference.
class TwoInputs : public AllGatherExtension {
 public:
  std::string name() const override { return "two_inputs"; }
  std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, const ShardInfo& info,
                                            c10::ScalarType) const override {
    ++pre_calls;
    max_world = std::max(max_world.load(), info.world);
    auto x = pad_shard(shard, info);
    return {x, -x};
  }
  torch::Tensor post_all_gather(const std::vector<torch::Tensor>& gathered, const ShardInfo& info,
                                c10::ScalarType dtype, const torch::Tensor& out) const override {
    ++post_calls;
    EXPECT_EQ(gathered.size(), 2u);
    EXPECT_EQ(gathered[0].size(0), info.world);
    out.copy_((unpad_cat(gathered[0], info, dtype, {}) - unpad_cat(gathered[1], info, dtype, {})) / 2);
    return out;
  }
  mutable std::atomic<int> pre_calls{0}, post_calls{0}, max_world{0};
};

TEST(FullyShard, AllGatherExtensionsGatherSeveralTensorsPerParameterInOneCollective) {
  testing::run_ranks({"dp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto m = make_stack();
    auto ext = std::make_shared<TwoInputs>();
    FullyShardOptions o{{"*"}, true};
    o.extension = ext;
    auto fs = apply_fully_shard(*m, g, o);
    const int setup_calls = ext->pre_calls;  // one per parameter, to lay out the buffers
    g.counter->reset();
    auto y = (*m)(input_of(g.rank));
    EXPECT_EQ(g.counter->get("all_gather").calls, 3);  // one per unit, however many inputs
    EXPECT_EQ(ext->pre_calls - setup_calls, 12);      // 12 parameters, once each
    EXPECT_EQ(ext->post_calls, 12);
    y.sum().backward();  // re-gathers write into the existing unsharded tensors
    EXPECT_EQ(ext->post_calls, 24);
    auto ref = reference_grads(2);
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      EXPECT_TRUE(torch::allclose(p.grad(), ref[n].chunk(2, 0)[g.rank], 1e-5, 1e-6)) << n;
    }
  });
}

TEST(FullyShard, HsdpReduceScattersOverShardAndAllReducesOverReplicate) {
  testing::run_ranks({"rep", "shard"}, {2, 2}, [](DeviceMesh& mesh) {
    auto& shard = mesh.group("shard");
    auto& rep = mesh.group("rep");
    const int dp_rank = rep.rank * 2 + shard.rank;
    auto m = make_stack();
    Placements pl;
    FullyShardOptions o{{"*"}, true};
    o.replicate = &rep;
    o.placements = &pl;
    auto fs = apply_fully_shard(*m, shard, o);
    std::vector<torch::Tensor> params;
    for (auto& [n, p] : nn::unique_named_parameters(*m)) params.push_back(p);
    GradSync sync(params, pl, {});
    EXPECT_EQ(grad_plan(*pl.find(params[0])).str(), "reduce-scatter shard, all-reduce rep (avg)");
    shard.counter->reset();
    rep.counter->reset();
    (*m)(input_of(dp_rank)).sum().backward();
    sync.finish();
    EXPECT_EQ(shard.counter->get("all_gather").calls, 6);
    EXPECT_EQ(shard.counter->get("reduce_scatter").calls, 3);
    EXPECT_EQ(sync.num_buckets(), 1u);                   // the replicate all-reduce: one bucket
    EXPECT_EQ(rep.counter->get("all_reduce").calls, 1);
    EXPECT_EQ(rep.counter->total().calls, 1);
    auto ref = reference_grads(4);
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      EXPECT_TRUE(torch::allclose(p.grad(), ref[n].chunk(2, 0)[shard.rank], 1e-5, 1e-6)) << n;
    }
  });
}

// docs/scenarios.md 4.5: HSDP on (replicate 2, shard 4) with an extension:
// its hooks see only the shard group (4 pieces gathered, never 8), and the
// gradients are the average over all 8 ranks' inputs.
TEST(FullyShard, HsdpExtensionsSeeOnlyTheShardGroup) {
  testing::run_ranks({"rep", "shard"}, {2, 4}, [](DeviceMesh& mesh) {
    auto& shard = mesh.group("shard");
    auto& rep = mesh.group("rep");
    auto m = make_stack();
    Placements pl;
    auto ext = std::make_shared<TwoInputs>();
    FullyShardOptions o{{"*"}, true};
    o.replicate = &rep;
    o.placements = &pl;
    o.extension = ext;
    auto fs = apply_fully_shard(*m, shard, o);
    std::vector<torch::Tensor> params;
    for (auto& [n, p] : nn::unique_named_parameters(*m)) params.push_back(p);
    GradSync sync(params, pl, {});
    (*m)(input_of(rep.rank * 4 + shard.rank)).sum().backward();
    sync.finish();
    EXPECT_EQ(ext->max_world, 4);  // the shard group's size, under a 2 x 4 mesh
    EXPECT_EQ(ext->post_calls, 24);
    auto ref = reference_grads(8);
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      EXPECT_TRUE(torch::allclose(p.grad(), ref[n].chunk(4, 0)[shard.rank], 1e-5, 1e-6)) << n;
    }
  });
}

models::TpPlan stack_plan() {
  const auto* spec = models::find_model("mlp_stack");
  models::ModelArgs a;
  for (const auto& arg : spec->args) a.set(arg.name, arg.default_value);
  a.set("mlp_dim", int64_t{17});
  return spec->tp_plan(a, false);
}

TEST(FullyShard, TwoDShardsTheTpLocalShardsOnTheOtherDim) {
  auto ref = reference_grads(2);
  testing::run_ranks({"dp", "tp"}, {2, 2}, [&](DeviceMesh& mesh) {
    auto& dp = mesh.group("dp");
    auto& tpg = mesh.group("tp");
    auto m = make_stack();
    Placements pl;
    auto tp = apply_tensor_parallel(*m, tpg, stack_plan(), pl);
    FullyShardOptions o{{"*"}, true};
    o.placements = &pl;
    o.shard_dim = [&](const torch::Tensor& p) -> int64_t {
      const TpShard* s = tp->shard_of(p);
      return s ? p.dim() - 1 - s->dim : 0;
    };
    auto fs = apply_fully_shard(*m, dp, o);
    auto w = m->named_parameters()["0.in_proj.weight"];  // [51, 17]: colwise Shard(0) -> fsdp dim 1
    EXPECT_EQ(fs->shard_info(w)->dim, 1);
    EXPECT_EQ(pl.find(w)->str(), "[51, 17] tp:S(0) dp:S(1)/P(avg)");
    EXPECT_EQ(w.size(0), 26 - tpg.rank);                 // 51 rows over tp: 26, 25
    EXPECT_EQ(w.size(1), 9 - dp.rank);                   // 17 columns over dp: 9, 8
    dp.counter->reset();
    (*m)(input_of(dp.rank)).sum().backward();
    EXPECT_EQ(dp.counter->get("all_gather").calls, 6);
    EXPECT_EQ(dp.counter->get("reduce_scatter").calls, 3);
    for (auto& [n, p] : nn::unique_named_parameters(*m)) {
      // Full gradient: gathered over dp on the fsdp dim, then over tp, by the placement.
      auto full = gather_full(*pl.find(p), p.grad());
      EXPECT_TRUE(torch::allclose(full, ref[n], 1e-5, 1e-5)) << n;
    }
  });
}

TEST(FullyShard, OneWayShardingAfterTp4KeepsTheScenarioCounts) {
  testing::run_ranks({"dp", "tp"}, {1, 4}, [](DeviceMesh& mesh) {
    auto& dp = mesh.group("dp");
    auto& tpg = mesh.group("tp");
    auto m = testing::seeded_model("mlp_stack", 3);
    const auto* spec = models::find_model("mlp_stack");
    models::ModelArgs a;
    for (const auto& arg : spec->args) a.set(arg.name, arg.default_value);
    Placements pl;
    apply_tensor_parallel(*m, tpg, spec->tp_plan(a, false), pl);
    auto fs = apply_fully_shard(*m, dp, {{"*"}, true});
    auto x = torch::linspace(-2, 2, 64).view({4, 16}).cos();
    tpg.counter->reset();
    auto y = (*m)(x);
    EXPECT_EQ(tpg.counter->get("all_reduce").calls, 3);  // docs/scenarios.md 2.A.3
    EXPECT_EQ(tpg.counter->total().calls, 3);
    tpg.counter->reset();
    y.sum().backward();
    EXPECT_EQ(tpg.counter->get("all_reduce").calls, 2);
    EXPECT_EQ(tpg.counter->total().calls, 2);
    EXPECT_EQ(dp.counter->total().calls, 0);  // 1-way fully_shard: no all-gather, no reduce-scatter
  });
}

}  // namespace
}  // namespace composer::parallel

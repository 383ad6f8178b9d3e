// Placements without process groups: torch.chunk boxes, a Shard of a Shard
// (fully_shard over tensor-parallel pieces), uneven and empty pieces, which
// copy counts in a global sum, and the reductions a gradient's placement
// calls for.
#include <gtest/gtest.h>

#include "models/registry.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/comm/mesh.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/placement.h"

namespace composer::parallel {
namespace {

SpecDim dim(const std::string& name, int size, int rank, Placement param, Placement grad) {
  SpecDim d;
  d.name = name;
  d.size = size;
  d.rank = rank;
  d.param = param;
  d.grad = grad;
  return d;
}

TEST(Placement, ShardBoxesFollowTorchChunkWithEmptyTails) {
  ShardSpec s;
  s.global_shape = {5, 3};
  s.dims.push_back(dim("dp", 4, 0, Placement::shard(0), Placement::partial(Reduce::kAvg)));
  // torch.chunk(5 rows, 4) = 2, 2, 1, and an empty fourth piece.
  std::vector<int64_t> sizes, offsets;
  for (int r = 0; r < 4; ++r) {
    Box b = s.box_at({r});
    sizes.push_back(b.size[0]);
    offsets.push_back(b.offset[0]);
    EXPECT_EQ(b.size[1], 3);
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 2, 4, 5}));
}

TEST(Placement, ShardOfAShardSplitsThePieceTheFirstLeft) {
  // tp shards 51 rows into 26 + 25; fully_shard then shards each tp piece's
  // rows again over dp (Shard(0) of Shard(0)), or its columns (opposite dims).
  ShardSpec s;
  s.global_shape = {51, 17};
  s.dims.push_back(dim("tp", 2, 1, Placement::shard(0), Placement::shard(0)));
  s.dims.push_back(dim("dp", 2, 1, Placement::shard(0), Placement::partial(Reduce::kAvg)));
  Box b = s.box_at({1, 1});
  EXPECT_EQ(b.offset, (std::vector<int64_t>{26 + 13, 0}));
  EXPECT_EQ(b.size, (std::vector<int64_t>{12, 17}));
  EXPECT_EQ(s.box_at({1, 0}).size, (std::vector<int64_t>{13, 17}));
  s.dims[1].param = Placement::shard(1);
  b = s.box_at({0, 1});
  EXPECT_EQ(b.offset, (std::vector<int64_t>{0, 9}));
  EXPECT_EQ(b.size, (std::vector<int64_t>{26, 8}));
  // Every element belongs to exactly one rank's box.
  auto owners = torch::zeros({51, 17}, torch::kInt);
  for (int t = 0; t < 2; ++t) {
    for (int d = 0; d < 2; ++d) {
      Box x = s.box_at({t, d});
      owners.narrow(0, x.offset[0], x.size[0]).narrow(1, x.offset[1], x.size[1]).add_(1);
    }
  }
  EXPECT_TRUE(owners.eq(1).all().item<bool>());
}

TEST(Placement, LocalPieceIsTheBoxOfTheFullTensor) {
  ShardSpec s;
  s.global_shape = {4, 6};
  s.dims.push_back(dim("tp", 2, 1, Placement::shard(1), Placement::shard(1)));
  s.dims.push_back(dim("dp", 2, 0, Placement::shard(0), Placement::partial(Reduce::kAvg)));
  auto full = torch::arange(24).view({4, 6});
  EXPECT_TRUE(local_piece(s, full).equal(full.narrow(1, 3, 3).narrow(0, 0, 2)));
  EXPECT_EQ(s.local_shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(s.str(), "[4, 6] tp:S(1) dp:S(0)/P(avg)");
}

TEST(Placement, OneCopyCountsInAGlobalSum) {
  ShardSpec s;
  s.global_shape = {8};
  s.dims.push_back(dim("tp", 2, 1, Placement::replicate(), Placement::partial()));
  s.dims.push_back(dim("dp", 2, 1, Placement::shard(0), Placement::partial(Reduce::kAvg)));
  SpecDim pp = dim("pp", 4, 3, Placement::replicate(), Placement::partial());
  pp.members = {0, 3};
  s.dims.push_back(pp);
  EXPECT_TRUE(s.held());
  EXPECT_FALSE(s.counts());  // tp rank 1 holds a copy of tp rank 0's piece
  s.dims[0].rank = 0;
  EXPECT_FALSE(s.counts());  // pp rank 3 holds a copy of pp rank 0's
  s.dims[2].rank = 0;
  EXPECT_TRUE(s.counts());   // dp rank 1's shard is its own
  s.dims[2].rank = 1;
  EXPECT_FALSE(s.held());
}

TEST(Placement, PartialGradientsCallForTheirReductions) {
  Group tp, dp, rep, pp01;
  tp.size = dp.size = rep.size = pp01.size = 2;
  ShardSpec s;
  s.global_shape = {8};
  SpecDim t = dim("tp", 2, 0, Placement::replicate(), Placement::partial(Reduce::kSum));
  t.group = &tp;
  SpecDim r = dim("rep", 2, 0, Placement::replicate(), Placement::partial(Reduce::kAvg));
  r.group = &rep;
  SpecDim d = dim("dp", 2, 0, Placement::shard(0), Placement::partial(Reduce::kAvg));
  d.group = &dp;
  SpecDim p = dim("pp", 4, 0, Placement::replicate(), Placement::partial(Reduce::kSum));
  p.members = {0, 1};
  p.member_group = &pp01;
  s.dims = {t, r, d, p};
  GradPlan plan = grad_plan(s);
  EXPECT_EQ(plan.reduce_scatters, std::vector<std::string>{"dp"});
  ASSERT_EQ(plan.all_reduces.size(), 3u);
  EXPECT_EQ(plan.all_reduces[0].group, &tp);
  EXPECT_EQ(plan.all_reduces[1].op, Reduce::kAvg);
  EXPECT_EQ(plan.all_reduces[2].group, &pp01);
  EXPECT_EQ(plan.str(), "reduce-scatter dp, all-reduce tp (sum), all-reduce rep (avg), all-reduce pp (sum)");
  // Replicated gradients, one-member pipeline dims and size-1 dims need nothing.
  s.dims[0].grad = Placement::replicate();
  s.dims[3].members = {2};
  s.dims[1].size = 1;
  s.dims[1].group->size = 1;
  EXPECT_EQ(grad_plan(s).str(), "reduce-scatter dp");
}

// A per-rank parameter (each data-parallel rank its own expert) is the stack of
// every rank's copy: rank 1 of 2 holds box [1, 0, 0] of [2, 12, 23], its
// gradient needs no reduction, and every rank's copy counts.
TEST(Placement, PerRankParametersStackOverTheGroup) {
  auto model = models::find_model("mixture_of_experts")->build({});
  Group group;
  group.name = "dp";
  group.size = 2;
  group.rank = 1;
  Placements placements;
  auto selected = apply_per_rank({models::whole(*model)}, group, {"module.2"}, placements);
  EXPECT_EQ(per_rank_params(*model, {"module.2"}), (std::vector<std::string>{"module.2.weight", "module.2.bias"}));
  EXPECT_EQ(selected.size(), 2u);
  for (auto& [name, p] : nn::unique_named_parameters(*model)) {
    const ShardSpec* s = placements.find(p);
    EXPECT_EQ(s != nullptr, name.rfind("module.2.", 0) == 0) << name;
    if (!s) continue;
    std::vector<int64_t> global{2};
    for (auto d : p.sizes()) global.push_back(d);
    EXPECT_EQ(s->global_shape, global) << name;
    EXPECT_EQ(s->box().offset.front(), 1) << name;
    EXPECT_EQ(s->box().size.front(), 1) << name;
    EXPECT_TRUE(s->counts()) << name;
    EXPECT_EQ(grad_plan(*s).str(), "none") << name;
  }
  EXPECT_FALSE(per_rank_selects({"module.2"}, "module.20.weight"));
  EXPECT_TRUE(per_rank_selects({"module.*"}, "module.0.bias"));
}

}  // namespace
}  // namespace composer::parallel

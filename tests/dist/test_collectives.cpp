// Every collective on real Gloo groups, with closed-form expected values,
// uneven sizes (torch.chunk semantics) and the communication counters.
#include <gtest/gtest.h>

#include <set>

#include "parallelisms/comm/collectives.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

torch::Tensor rank_tensor(int rank, std::vector<int64_t> shape) {
  return torch::arange(torch::ones(shape).numel(), torch::kFloat).view(shape) + 100.0f * rank;
}

TEST(ChunkSizes, FollowTorchChunk) {
  EXPECT_EQ(chunk_sizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(chunk_sizes(7, 3), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(chunk_sizes(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  EXPECT_EQ(chunk_sizes(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(chunk_sizes(9, 8), (std::vector<int64_t>{2, 2, 2, 2, 1, 0, 0, 0}));
}

TEST(Collectives, AllReduceSumAvgMax) {
  testing::run_ranks({"dp"}, {3}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto s = rank_tensor(g.rank, {2, 2});
    all_reduce(g, s);
    EXPECT_TRUE(s.equal(rank_tensor(0, {2, 2}) * 3 + 300));
    auto a = rank_tensor(g.rank, {3});
    all_reduce(g, a, Reduce::kAvg);
    EXPECT_TRUE(torch::allclose(a, rank_tensor(0, {3}) + 100));
    auto m = torch::tensor({static_cast<float>(g.rank)});
    all_reduce(g, m, Reduce::kMax);
    EXPECT_EQ(m.item<float>(), 2.0f);
    auto h = torch::ones({4});
    Handle pending = all_reduce(g, h, Reduce::kSum, /*async=*/true);
    pending.wait();
    EXPECT_TRUE(h.eq(3).all().item<bool>());
  });
}

TEST(Collectives, AllReduceBFloat16SumsInFloat32AndRoundsOnce) {
  // Gloo reduces no bfloat16. Rank 0 holds 256 and the others 1, each exact
  // in bfloat16 (8 significant bits: spacing 2 at 256). A bfloat16 ring
  // would round 256 + 1 back to 256 (a tie, to even) at every hop; the
  // float32 sum is 258, exact in bfloat16.
  testing::run_ranks({"dp"}, {3}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto s = torch::full({5}, g.rank == 0 ? 256.0 : 1.0, torch::kBFloat16);
    all_reduce(g, s);
    EXPECT_TRUE(s.eq(258.0).all().item<bool>()) << s;
    EXPECT_EQ(s.scalar_type(), torch::kBFloat16);
    auto a = torch::full({3}, 2.0 * (g.rank + 1), torch::kBFloat16);
    Handle pending = all_reduce(g, a, Reduce::kAvg, /*async=*/true);
    pending.wait();
    EXPECT_TRUE(a.eq(4.0).all().item<bool>());
  });
}

TEST(Collectives, BroadcastAndAllGatherMoveBFloat16Bits) {
  // Values far outside float16's range travel unchanged (as bytes).
  testing::run_ranks({"dp"}, {3}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto mine = torch::full({g.rank == 2 ? 1 : 2, 2}, 1e30 * (g.rank + 1), torch::kBFloat16);
    auto all = all_gather(g, mine, {2, 2, 1});
    ASSERT_EQ(all.scalar_type(), torch::kBFloat16);
    auto expect = torch::cat({torch::full({2, 2}, 1e30, torch::kBFloat16), torch::full({2, 2}, 2e30, torch::kBFloat16),
                              torch::full({1, 2}, 3e30, torch::kBFloat16)});
    EXPECT_TRUE(all.equal(expect)) << all;
    auto b = torch::full({4}, -1e-30 * (g.rank + 1), torch::kBFloat16);
    broadcast(g, b, 1);
    EXPECT_TRUE(b.equal(torch::full({4}, -2e-30, torch::kBFloat16))) << b;
  });
}

TEST(Collectives, Broadcast) {
  testing::run_ranks({"dp"}, {4}, [](DeviceMesh& mesh) {
    auto t = rank_tensor(mesh.rank(), {5});
    broadcast(mesh.group("dp"), t, 2);
    EXPECT_TRUE(t.equal(rank_tensor(2, {5})));
  });
}

TEST(Collectives, AllGatherEvenAndUneven) {
  for (int64_t rows : {8, 5, 3}) {
    testing::run_ranks({"dp"}, {4}, [rows](DeviceMesh& mesh) {
      auto& g = mesh.group("dp");
      auto full = torch::arange(rows * 3, torch::kFloat).view({rows, 3});
      auto sizes = chunk_sizes(rows, 4);
      auto mine = full.chunk(4, 0).size() > static_cast<size_t>(g.rank) ? full.chunk(4, 0)[g.rank]
                                                                         : torch::empty({0, 3});
      ASSERT_EQ(mine.size(0), sizes[g.rank]);
      EXPECT_TRUE(all_gather(g, mine.contiguous(), sizes).equal(full)) << rows << " rows";
    });
  }
}

TEST(Collectives, ReduceScatterEvenAndUneven) {
  for (int64_t rows : {8, 7, 3}) {
    testing::run_ranks({"dp"}, {4}, [rows](DeviceMesh& mesh) {
      auto& g = mesh.group("dp");
      auto input = rank_tensor(g.rank, {rows, 2});
      auto sum = rank_tensor(0, {rows, 2}) * 4 + 600;  // 100 * (0+1+2+3)
      auto sizes = chunk_sizes(rows, 4);
      int64_t start = 0;
      for (int i = 0; i < g.rank; ++i) start += sizes[i];
      auto out = reduce_scatter(g, input);
      EXPECT_EQ(out.sizes(), (std::vector<int64_t>{sizes[g.rank], 2}));
      EXPECT_TRUE(out.equal(sum.narrow(0, start, sizes[g.rank]))) << rows << " rows, rank " << g.rank;
      auto avg = reduce_scatter(g, input, Reduce::kAvg);
      EXPECT_TRUE(torch::allclose(avg, sum.narrow(0, start, sizes[g.rank]) / 4));
    });
  }
}

// The activation collectives move pieces of a middle or last dim without
// moving that dim first: uneven pieces (an empty one at 4 ranks), the input
// left as it was, and the sums in every rank's piece.
TEST(Collectives, GatherAndReduceScatterAlongAMiddleAndTheLastDim) {
  for (int64_t dim : {1, 2}) {
    for (int64_t len : {8, 7, 3}) {
      testing::run_ranks({"tp"}, {4}, [dim, len](DeviceMesh& mesh) {
        auto& g = mesh.group("tp");
        std::vector<int64_t> shape{2, 3, 4};
        shape[dim] = len;
        auto full = rank_tensor(0, shape);
        auto sizes = chunk_sizes(len, 4);
        const int64_t start = offset_of(sizes, g.rank);
        auto mine = full.narrow(dim, start, sizes[g.rank]);
        auto gathered = gather_along(g, mine, dim, len, /*backward_reduce=*/true);
        EXPECT_TRUE(gathered.equal(full)) << "dim " << dim << ", " << len;
        EXPECT_TRUE(gathered.is_contiguous());

        auto input = rank_tensor(g.rank, shape);
        auto before = input.clone();
        auto sum = rank_tensor(0, shape) * 4 + 600;  // 100 * (0+1+2+3)
        auto out = reduce_scatter_along(g, input, dim);
        EXPECT_TRUE(out.equal(sum.narrow(dim, start, sizes[g.rank]))) << "dim " << dim << ", " << len;
        EXPECT_TRUE(input.equal(before));

        // Autograd: the gather's backward reduce-scatters, the reduce-scatter's gathers.
        auto x = mine.clone().requires_grad_(true);
        auto w = rank_tensor(g.rank, shape);
        (gather_along(g, x, dim, len, true) * w).sum().backward();
        EXPECT_TRUE(x.grad().equal(sum.narrow(dim, start, sizes[g.rank])));
        auto y = input.clone().requires_grad_(true);
        auto piece_w = rank_tensor(g.rank, shape).narrow(dim, start, sizes[g.rank]);
        (reduce_scatter_along(g, y, dim) * piece_w).sum().backward();
        std::vector<torch::Tensor> pieces;
        for (int i = 0; i < 4; ++i) pieces.push_back(rank_tensor(i, shape).narrow(dim, offset_of(sizes, i), sizes[i]));
        EXPECT_TRUE(y.grad().equal(torch::cat(pieces, dim)));
      });
    }
  }
}

// The fused forms (the ring over Gloo; the rooted one NCCL and device
// tensors over Gloo take) against closed forms: the pieces handed to `each`,
// once per rank and this rank's first, and the reduce-scatter of addends
// that only `partial` computes. Integer values: every order of addition is exact.
TEST(Collectives, FusedGatherAndReduceScatterRingAndRooted) {
  for (int64_t dim : {1, -1}) {
    for (int64_t len : {8, 7, 3}) {
      testing::run_ranks({"tp"}, {4}, [dim, len](DeviceMesh& mesh) {
        auto& g = mesh.group("tp");
        std::vector<int64_t> shape{2, 3, 4};
        const int64_t d = dim < 0 ? dim + 3 : dim;
        shape[d] = len;
        const auto sizes = chunk_sizes(len, 4);
        auto full = rank_tensor(0, shape);
        auto mine = full.narrow(d, offset_of(sizes, g.rank), sizes[g.rank]);
        auto addend = [&](int rank, int i) {  // rank's addend of piece i
          return rank_tensor(rank, shape).narrow(d, offset_of(sizes, i), sizes[i]) * (i + 1);
        };
        auto sum = addend(0, g.rank) * 4 + 600 * (g.rank + 1);  // 100 * (0+1+2+3) per unit
        for (bool rooted : {false, true}) {
          const std::string form = rooted ? "rooted" : "ring";
          std::vector<int> order;
          std::vector<torch::Tensor> seen(4);
          auto each = [&](int i, const torch::Tensor& piece) {
            order.push_back(i);
            seen[i] = piece.clone();
          };
          auto pieces = rooted ? gather_each_by_root(g, mine, dim, len, each) : gather_along_each(g, mine, dim, len, each);
          ASSERT_EQ(order.size(), 4u) << form;
          EXPECT_EQ(order.front(), g.rank) << form;
          EXPECT_EQ(std::set<int>(order.begin(), order.end()).size(), 4u) << form;
          EXPECT_TRUE(torch::cat(pieces, d).equal(full)) << form << " dim " << dim << ", " << len;
          EXPECT_TRUE(torch::cat(seen, d).equal(full)) << form;

          std::vector<int> computed;
          auto partial = [&](int i) {
            computed.push_back(i);
            return addend(g.rank, i);
          };
          auto out = rooted ? reduce_scatter_by_root(g, dim, len, partial) : reduce_scatter_computed(g, dim, len, partial);
          EXPECT_EQ(computed.size(), 4u) << form;
          EXPECT_TRUE(out.equal(sum)) << form << " dim " << dim << ", " << len << "\n" << out << sum;
        }
        // 16-bit addends: Gloo sums none, so the rooted form sums them in
        // float32 and rounds once. Rank 0 adds 256 and the others 1 (spacing 2
        // at 256 in bfloat16): 259 rounds to 260 once; hop by hop it would stay 256.
        auto b = reduce_scatter_by_root(g, dim, len, [&](int i) {
          return torch::full(addend(0, i).sizes(), g.rank == 0 ? 256.0 : 1.0, torch::kBFloat16);
        });
        EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
        EXPECT_TRUE(b.eq(260.0).all().item<bool>()) << b;
      });
    }
  }
}

TEST(Collectives, SendRecv) {
  testing::run_ranks({"pp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("pp");
    if (g.rank == 0) {
      send(g, torch::full({3}, 7.0f), 1, 5);
    } else {
      auto t = torch::zeros({3});
      recv(g, t, 0, 5);
      EXPECT_TRUE(t.eq(7).all().item<bool>());
    }
  });
}

// Receives posted ahead of their sends, in another order than the sends
// come, each complete at its own wait(): what the pipeline runtime relies on
// when it posts a stage's receives while the action before them computes.
TEST(Collectives, AsyncRecvPostedBeforeTheSendsInAnyOrder) {
  testing::run_ranks({"pp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("pp");
    if (g.rank == 1) {
      auto a = torch::zeros({4}), b = torch::zeros({2, 3}, torch::kDouble);
      Handle hb = recv(g, b, 0, /*tag=*/12, /*async=*/true);
      Handle ha = recv(g, a, 0, /*tag=*/11, /*async=*/true);
      send(g, torch::ones({1}), 0, 10);  // only now does rank 0 send
      ha.wait();
      EXPECT_TRUE(a.equal(torch::arange(4, torch::kFloat)));
      EXPECT_TRUE(hb.pending());
      hb.wait();
      EXPECT_FALSE(hb.pending());
      EXPECT_TRUE(b.equal(torch::full({2, 3}, -2.5, torch::kDouble)));
    } else {
      auto go = torch::zeros({1});
      recv(g, go, 1, 10);
      EXPECT_EQ(go.item<float>(), 1.0f);
      Handle s1 = send(g, torch::arange(4, torch::kFloat), 1, 11, /*async=*/true);
      send(g, torch::full({2, 3}, -2.5, torch::kDouble), 1, 12);
      s1.wait();
    }
  });
}

TEST(Collectives, AutogradAllGatherBackwardIsReduceScatter) {
  testing::run_ranks({"dp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("dp");
    auto shard = torch::full({3, 2}, static_cast<float>(g.rank + 1), torch::requires_grad());
    auto full = all_gather_autograd(g, shard, {3, 3});
    EXPECT_EQ(full.size(0), 6);
    // d/dshard of sum(full * w) is this rank's rows of w, summed over ranks.
    auto w = torch::arange(12, torch::kFloat).view({6, 2});
    (full * w).sum().backward();
    EXPECT_TRUE(shard.grad().equal(w.narrow(0, 3 * g.rank, 3) * 2));
  });
}

TEST(Collectives, AutogradAllReduceAndReduceGrad) {
  testing::run_ranks({"tp"}, {2}, [](DeviceMesh& mesh) {
    auto& g = mesh.group("tp");
    auto x = torch::full({2}, static_cast<float>(g.rank + 1), torch::requires_grad());
    auto y = all_reduce_autograd(g, x);
    EXPECT_TRUE(y.eq(3).all().item<bool>());
    y.sum().backward();
    EXPECT_TRUE(x.grad().eq(1).all().item<bool>());  // identity backward
    auto z = torch::ones({2}, torch::requires_grad());
    (reduce_grad_autograd(g, z) * static_cast<float>(g.rank + 1)).sum().backward();
    EXPECT_TRUE(z.grad().eq(3).all().item<bool>());  // gradients summed over the group
    auto big = torch::full({5, 1}, static_cast<float>(g.rank), torch::requires_grad());
    auto part = reduce_scatter_autograd(g, big);
    EXPECT_EQ(part.size(0), g.rank == 0 ? 3 : 2);
    part.sum().backward();
    EXPECT_TRUE(big.grad().eq(1).all().item<bool>());
  });
}

TEST(Collectives, CountersRecordCallsAndBytesAndSizeOneGroupsIssueNothing) {
  testing::run_ranks({"dp", "tp"}, {2, 1}, [](DeviceMesh& mesh) {
    auto& dp = mesh.group("dp");
    auto& tp = mesh.group("tp");
    auto t = torch::ones({10});
    all_reduce(dp, t);
    all_reduce(dp, t);
    all_reduce(tp, t);
    reduce_scatter(tp, torch::ones({4}));
    auto e = dp.counter->get("all_reduce");
    EXPECT_EQ(e.calls, 2);
    EXPECT_EQ(e.bytes, 80);
    EXPECT_EQ(e.ring_bytes, 80);  // 2 (N-1)/N x 40 bytes per call at N = 2
    EXPECT_EQ(tp.counter->total().calls, 0);
    auto rs = torch::ones({4, 3});
    reduce_scatter(dp, rs);
    EXPECT_EQ(dp.counter->get("reduce_scatter").calls, 1);
    EXPECT_EQ(dp.counter->get("reduce_scatter").ring_bytes, 24);  // (N-1)/N x 48 bytes
  });
}

}  // namespace
}  // namespace composer::parallel

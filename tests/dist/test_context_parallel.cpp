// context_parallel's attention on real Gloo groups: every rank's output and
// its query, key and value gradients equal one device's attention over the
// whole sequence, sliced to the rank's positions, for the ring and allgather
// rotations, load-balanced and contiguous layouts, causal and full masks and
// grouped-query attention; and the ring moves exactly its theoretical bytes.
#include <gtest/gtest.h>

#include "models/layers.h"
#include "parallelisms/context_parallel.h"
#include "tests/dist/ranks.h"

namespace composer::parallel {
namespace {

struct Case {
  int cp;
  bool load_balance;
  Rotate rotate;
  bool causal;
  int64_t heads, kv_heads;
  int64_t seq = 24, batch = 2;
};

constexpr int64_t kHeadDim = 8;

// The same q, k, v (batch, heads, seq, head_dim) and output gradient on every rank.
std::vector<torch::Tensor> inputs(const Case& c) {
  std::lock_guard<std::mutex> lock(testing::rng_mutex());
  torch::manual_seed(7);
  return {torch::randn({c.batch, c.heads, c.seq, kHeadDim}), torch::randn({c.batch, c.kv_heads, c.seq, kHeadDim}),
          torch::randn({c.batch, c.kv_heads, c.seq, kHeadDim}), torch::randn({c.batch, c.heads, c.seq, kHeadDim})};
}

void check_case(const Case& c) {
  testing::run_ranks({"cp"}, {c.cp}, [&](DeviceMesh& mesh) {
    auto in = inputs(c);
    const int64_t n_rep = c.heads / c.kv_heads;
    // One device: the model's attention with the key/value heads repeated, on the whole sequence.
    auto q = in[0].clone().requires_grad_(), k = in[1].clone().requires_grad_(), v = in[2].clone().requires_grad_();
    auto full = nn::attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), c.causal, 0, false);
    full.backward(in[3]);
    // This rank: its slice of everything, attention through the split.
    Group& g = mesh.group("cp");
    ContextParallel cp(g, {{"cp"}, c.load_balance, c.rotate});
    auto lq = cp.slice(in[0], 2).requires_grad_(), lk = cp.slice(in[1], 2).requires_grad_();
    auto lv = cp.slice(in[2], 2).requires_grad_();
    auto out = cp.attention(lq, lk, lv, c.causal, {});
    out.backward(cp.slice(in[3], 2));
    const double tol = 1e-5;
    EXPECT_TRUE(torch::allclose(out, cp.slice(full.detach(), 2), tol, tol)) << "output, rank " << g.rank;
    EXPECT_TRUE(torch::allclose(lq.grad(), cp.slice(q.grad(), 2), tol, tol)) << "dq, rank " << g.rank;
    EXPECT_TRUE(torch::allclose(lk.grad(), cp.slice(k.grad(), 2), tol, tol)) << "dk, rank " << g.rank;
    EXPECT_TRUE(torch::allclose(lv.grad(), cp.slice(v.grad(), 2), tol, tol)) << "dv, rank " << g.rank;
  });
}

TEST(ContextParallel, SequenceChunksAreHeadAndTail) {
  EXPECT_EQ(sequence_chunks(4, 0, true), (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(sequence_chunks(4, 3, true), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(sequence_chunks(4, 2, false), (std::vector<int64_t>{2}));
  EXPECT_EQ(chunks_per_sequence(3, true), 6);
  testing::run_ranks({"cp"}, {2}, [&](DeviceMesh& mesh) {
    ContextParallel cp(mesh.group("cp"), {});
    auto ids = torch::arange(8).view({1, 8});
    auto want = mesh.rank() == 0 ? std::vector<int64_t>{0, 1, 6, 7} : std::vector<int64_t>{2, 3, 4, 5};
    auto got = cp.slice(ids, 1).view({-1});
    EXPECT_EQ(std::vector<int64_t>(got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + 4), want);
    EXPECT_TRUE(torch::equal(cp.positions(4, c10::kCPU), got));
  });
}

TEST(ContextParallel, RingLoadBalancedCausal) { check_case({2, true, Rotate::kRing, true, 4, 4}); }
TEST(ContextParallel, RingFourRanksGroupedQuery) { check_case({4, true, Rotate::kRing, true, 4, 2}); }
TEST(ContextParallel, RingThreeRanksContiguous) { check_case({3, false, Rotate::kRing, true, 2, 1}); }
TEST(ContextParallel, RingFullMask) { check_case({3, true, Rotate::kRing, false, 2, 2}); }
// Chunks of 600 tokens: attention runs over tiles of 256, 256 and 88, whose causal
// masks do not fall on the chunk grid.
TEST(ContextParallel, RingTilesLongChunks) { check_case({2, true, Rotate::kRing, true, 2, 1, 2400, 1}); }
TEST(ContextParallel, AllGatherLoadBalanced) { check_case({4, true, Rotate::kAllGather, true, 4, 2}); }
TEST(ContextParallel, AllGatherContiguousFullMask) { check_case({2, false, Rotate::kAllGather, false, 2, 2}); }

// The ring's bytes per rank: forward sends the (k, v) block n-1 times; backward
// sends it n-1 times more and its float32 gradient n times (home after a turn).
TEST(ContextParallel, RingMovesItsTheoreticalBytes) {
  const int n = 4;
  testing::run_ranks({"cp"}, {n}, [&](DeviceMesh& mesh) {
    Case c{n, true, Rotate::kRing, true, 4, 2};
    auto in = inputs(c);
    Group& g = mesh.group("cp");
    ContextParallel cp(g, {});
    auto lq = cp.slice(in[0], 2).requires_grad_(), lk = cp.slice(in[1], 2).requires_grad_();
    auto lv = cp.slice(in[2], 2).requires_grad_();
    g.counter->reset();
    auto out = cp.attention(lq, lk, lv, true, {});
    const int64_t block = 2 * lk.numel() * 4;  // k and v, float32
    EXPECT_EQ(g.counter->get("send").bytes, (n - 1) * block);
    out.backward(cp.slice(in[3], 2));
    EXPECT_EQ(g.counter->get("send").bytes, 2 * (n - 1) * block + n * block);
    EXPECT_EQ(g.counter->get("send").calls, 2 * (n - 1) + n);
  });
}

}  // namespace
}  // namespace composer::parallel

// composer's meta kernels allocate what the CPU kernels allocate: the bytes a
// dry run counts for an operator equal those a real run counts for it. Also the
// mixture of experts' grouped products against its per-expert ones, whose
// estimate these kernels make.
#include <gtest/gtest.h>

#include "models/layers.h"
#include "models/moe.h"
#include "runner/estimate/estimate.h"
#include "runner/base/memory.h"

namespace composer {
namespace {

// The bytes an operator allocates beyond what is alive when it starts (its
// result and whatever it holds while it runs), on the CPU and on meta.
template <typename Op>
int64_t cpu_extra(Op op) {
  memory::reset_peak();
  const int64_t before = memory::live_bytes();
  { auto out = op(); }
  return memory::peak_bytes() - before;
}

template <typename Op>
int64_t meta_extra(memory::MetaCount& count, Op op) {
  count.reset_peak();
  const int64_t before = count.live();
  { auto out = op(); }
  return count.peak() - before;
}

TEST(MetaMatmul, AllocatesWhatTheCpuKernelAllocatesScratchSpaceIncluded) {
  ensure_meta_kernels();
  memory::install_counting_allocator();
  ASSERT_TRUE(memory::counting());
  struct Case {
    memory::MatmulKind kind;
    std::vector<int64_t> a, b;
    bool transpose_b;
  };
  // A Linear's forward (addmm with the weight transposed), its backward's two
  // mms, and attention's batched products, at the sizes of the parity models.
  const std::vector<Case> cases = {{memory::MatmulKind::kAddmm, {8, 17}, {51, 17}, true},
                                   {memory::MatmulKind::kMm, {8, 51}, {51, 17}, false},
                                   {memory::MatmulKind::kMm, {17, 8}, {8, 51}, false},
                                   {memory::MatmulKind::kAddmm, {64, 64}, {256, 64}, true},
                                   {memory::MatmulKind::kBmm, {4, 16, 8}, {4, 8, 16}, false},
                                   {memory::MatmulKind::kBaddbmm, {4, 16, 8}, {4, 8, 16}, false}};
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    for (const auto& c : cases) {
      auto make = [&](torch::Device device) {
        auto o = torch::TensorOptions().dtype(dtype).device(device);
        auto a = torch::zeros(c.a, o);
        auto b = c.transpose_b ? torch::zeros(c.b, o).t() : torch::zeros(c.b, o);
        auto bias = torch::zeros({b.size(-1)}, o);
        return std::make_tuple(a, b, bias);
      };
      auto run = [&c](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& bias) {
        switch (c.kind) {
          case memory::MatmulKind::kMm: return torch::mm(a, b);
          case memory::MatmulKind::kAddmm: return torch::addmm(bias, a, b);
          case memory::MatmulKind::kBmm: return torch::bmm(a, b);
          case memory::MatmulKind::kBaddbmm: return torch::baddbmm(bias, a, b);
        }
        return torch::Tensor();
      };
      auto [a, b, bias] = make(torch::kCPU);
      const int64_t real = cpu_extra([&] { return run(a, b, bias); });
      memory::MetaCount count;
      memory::CpuMatmulWorkspaces workspaces(at::get_num_threads());
      auto [ma, mb, mbias] = make(torch::kMeta);
      const int64_t dry = meta_extra(count, [&] { return run(ma, mb, mbias); });
      const int64_t result = run(ma, mb, mbias).numel() * static_cast<int64_t>(ma.element_size());
      EXPECT_GE(real, result);
      EXPECT_EQ(dry, real) << torch::toString(dtype) << " " << static_cast<int>(c.kind) << " " << c.a << " x " << c.b;
    }
  }
}

TEST(MetaMatmul, RefusesShapesThatCannotBeMultiplied) {
  ensure_meta_kernels();
  auto o = torch::TensorOptions().device(torch::kMeta);
  EXPECT_THROW(
      {
        try {
          torch::mm(torch::empty({8, 17}, o), torch::empty({16, 51}, o));
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("cannot be multiplied (8x17 and 16x51)"), std::string::npos) << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(torch::bmm(torch::empty({2, 3, 4}, o), torch::empty({2, 5, 6}, o)), c10::Error);
  EXPECT_THROW(torch::mm(torch::empty({2, 3}, o), torch::empty({3, 4}, o.dtype(torch::kBFloat16))), c10::Error);
  EXPECT_EQ(torch::addmm(torch::empty({51}, o), torch::empty({8, 17}, o), torch::empty({17, 51}, o)).sizes(),
            (std::vector<int64_t>{8, 51}));
}

// The dry run counts attention as the kernel LibTorch picks runs it: a fused kernel (a GPU's always,
// the CPU's flash kernel without active dropout) leaves the output and a float32 log-sum-exp per query
// row alive for backward, never the [seq x seq] scores; the CPU's math fallback under dropout keeps
// them.
TEST(MetaAttention, FusedKernelsKeepNoScores) {
  const int64_t b = 2, h = 4, s = 128, d = 16;
  auto o = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kMeta).requires_grad(true);
  auto kept = [&](bool cuda, double dropout, bool training) {
    memory::MetaCount count;
    nn::GpuKernelShapes shapes(cuda);
    auto q = torch::empty({b, h, s, d}, o), k = torch::empty({b, h, s, d}, o), v = torch::empty({b, h, s, d}, o);
    const int64_t before = count.live();
    auto out = nn::attention(q, k, v, /*causal=*/true, dropout, training);
    const int64_t alive = count.live() - before;
    out.sum().backward();
    EXPECT_TRUE(q.grad().defined() && k.grad().defined() && v.grad().defined());
    return alive;
  };
  const int64_t output = b * h * s * d * 2, logsumexp = b * h * s * 4, scores = b * h * s * s * 2;
  EXPECT_EQ(kept(/*cuda=*/true, 0.0, true), output + logsumexp);
  EXPECT_EQ(kept(/*cuda=*/true, 0.1, true), output + logsumexp);
  EXPECT_EQ(kept(/*cuda=*/false, 0.0, true), output + logsumexp);
  EXPECT_EQ(kept(/*cuda=*/false, 0.1, /*training=*/false), output + logsumexp);
  EXPECT_GE(kept(/*cuda=*/false, 0.1, true), output + scores);
}

// A cuda plan's dry run counts RMSNorm as PyTorch's fused kernel runs it:
// the output, and the input and a float32 inverse RMS per row kept for
// backward; the CPU's float32 form keeps a float32 copy of a bfloat16 input
// and the normalised input as well. A weight of another dtype than the
// input's takes the float32 form on a GPU too (F.rms_norm's condition).
TEST(MetaRmsNorm, TheGpusFusedKernelKeepsTheInputAndAnInverseRmsPerRow) {
  const int64_t rows = 2 * 64, dim = 96;
  auto kept = [&](bool cuda, torch::Dtype weight_dtype) {
    memory::MetaCount count;
    nn::GpuKernelShapes shapes(cuda);
    nn::RMSNorm norm(dim);
    auto o = torch::TensorOptions().device(torch::kMeta);
    auto w = torch::empty({dim}, o.dtype(weight_dtype).requires_grad(true));
    norm.set_view(norm.weight, w);  // the weight forward computes with, as fully_shard installs it
    auto x = torch::empty({2, 64, dim}, o.dtype(torch::kBFloat16).requires_grad(true));
    const int64_t before = count.live();
    auto out = norm.forward(x);
    const int64_t alive = count.live() - before;
    out.sum().backward();
    EXPECT_TRUE(x.grad().defined() && w.grad().defined());
    return alive;
  };
  const int64_t output = rows * dim * 2, inverse_rms = rows * 4;
  EXPECT_EQ(kept(/*cuda=*/true, torch::kBFloat16), output + inverse_rms);
  EXPECT_GE(kept(/*cuda=*/false, torch::kBFloat16), output + rows * dim * 4);
  EXPECT_GE(kept(/*cuda=*/true, torch::kFloat), output + rows * dim * 4);
}

// The routed experts' SwiGLU once grouped (at::_grouped_mm per projection)
// and once an expert at a time, from the same weights and rows, with an expert
// given no rows. The products are the same on the CPU; the elementwise SiLU and
// product between them run over the whole rows or each expert's, and ATen's
// vectorised loops compute a chunk's tail of fewer than 16 floats with the
// scalar functions, so the two agree bit for bit where every expert's rows
// start and end on a chunk (hidden a multiple of 16), and within a few units
// in the last place otherwise.
struct ExpertsRun {
  torch::Tensor out, dx, dw1, dw2, dw3;
};

ExpertsRun run_experts(bool grouped, torch::Dtype dtype, int64_t dim, int64_t hidden,
                       const std::vector<int64_t>& counts) {
  torch::manual_seed(3);
  models::GroupedExperts e(static_cast<int64_t>(counts.size()), dim, hidden, grouped);
  {
    torch::NoGradGuard no_grad;
    for (auto* w : {&e.w1, &e.w2, &e.w3}) w->copy_(torch::randn(w->sizes()) * 0.3);
  }
  int64_t rows = 0;
  for (auto c : counts) rows += c;
  auto x = torch::randn({rows, dim}).to(dtype).requires_grad_();
  auto g = torch::randn({rows, dim}).to(dtype);
  auto out = e.run(x, counts);
  out.backward(g);
  return {out.detach(), x.grad(), e.w1.grad(), e.w2.grad(), e.w3.grad()};
}

void expect_same(const ExpertsRun& a, const ExpertsRun& b, const std::string& what) {
  EXPECT_TRUE(torch::equal(a.out, b.out)) << what << ": output";
  EXPECT_TRUE(torch::equal(a.dx, b.dx)) << what << ": rows' gradient";
  EXPECT_TRUE(torch::equal(a.dw1, b.dw1)) << what << ": w1's gradient";
  EXPECT_TRUE(torch::equal(a.dw2, b.dw2)) << what << ": w2's gradient";
  EXPECT_TRUE(torch::equal(a.dw3, b.dw3)) << what << ": w3's gradient";
}

TEST(GroupedExperts, GroupedProductsGiveThePerExpertValues) {
  const std::vector<std::vector<int64_t>> cases = {{3, 0, 5, 2}, {0, 0, 0, 0}, {7, 1, 0, 9}};
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const auto& counts : cases) {
      const std::string what = c10::str(torch::toString(dtype), " ", counts);
      const auto grouped = run_experts(true, dtype, 16, 32, counts), each = run_experts(false, dtype, 16, 32, counts);
      expect_same(grouped, each, what);
      EXPECT_GT(grouped.dw1.abs().sum().item<double>() + (counts[0] + counts[3] == 0), 0) << what;
    }
  }
  // hidden 24: the tails differ; float32's rounding, a few units at the largest value.
  for (const auto& counts : cases) {
    const auto grouped = run_experts(true, torch::kFloat, 16, 24, counts), each = run_experts(false, torch::kFloat, 16, 24, counts);
    const std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs = {
        {grouped.out, each.out}, {grouped.dx, each.dx}, {grouped.dw1, each.dw1}, {grouped.dw2, each.dw2}, {grouped.dw3, each.dw3}};
    for (const auto& [a, b] : pairs) {
      if (b.numel() == 0) continue;  // no rows: no output, no rows' gradient
      EXPECT_LE((a - b).abs().max().item<double>(), 8 * 1.2e-7 * b.abs().max().item<double>()) << c10::str(counts);
    }
  }
}

// Widths that are not 16-byte multiples (hidden 6 in float32), and float64,
// which ATen's grouped product does not take: the per-expert products run.
TEST(GroupedExperts, WidthsTheKernelCannotTakeRunPerExpert) {
  models::GroupedExperts narrow(4, 16, 6), wide(4, 16, 24);
  EXPECT_FALSE(narrow.grouped_kernel_holds(torch::zeros({5, 16})));
  EXPECT_TRUE(wide.grouped_kernel_holds(torch::zeros({5, 16})));
  EXPECT_TRUE(wide.grouped_kernel_holds(torch::zeros({5, 16}, torch::kBFloat16)));
  EXPECT_FALSE(wide.grouped_kernel_holds(torch::zeros({5, 16}, torch::kDouble)));
  EXPECT_TRUE(wide.grouped_kernel_holds(torch::zeros({5, 16}, torch::TensorOptions().device(torch::kMeta))));
  expect_same(run_experts(true, torch::kFloat, 16, 6, {3, 0, 5, 2}), run_experts(false, torch::kFloat, 16, 6, {3, 0, 5, 2}),
              "hidden 6");
}

// The dry run counts the grouped experts' forward and backward as the CPU run
// allocates them (an even split of the rows, as the dry run routes): the live
// bytes after forward (what backward keeps) and the peak through backward.
TEST(MetaGroupedMm, TheExpertsForwardAndBackwardCountWhatTheCpuAllocates) {
  ensure_meta_kernels();
  memory::install_counting_allocator();
  ASSERT_TRUE(memory::counting());
  const int64_t experts = 4, dim = 32, hidden = 48, each = 24;
  const std::vector<int64_t> counts(experts, each);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    models::GroupedExperts e(experts, dim, hidden);
    auto measure = [&](torch::Device device, auto live, auto peak, auto reset) {
      auto o = torch::TensorOptions().dtype(dtype).device(device);
      auto w1 = torch::zeros({experts, hidden, dim}, o).requires_grad_(), w3 = torch::zeros_like(w1).requires_grad_();
      auto w2 = torch::zeros({experts, dim, hidden}, o).requires_grad_();
      e.set_view(e.w1, w1), e.set_view(e.w2, w2), e.set_view(e.w3, w3);
      auto x = torch::zeros({experts * each, dim}, o).requires_grad_();
      auto g = torch::zeros({experts * each, dim}, o);
      reset();
      const int64_t before = live();
      int64_t kept = 0;
      {
        auto out = e.run(x, counts);
        kept = live() - before;
        out.backward(g);
      }
      return std::make_pair(kept, peak() - before);
    };
    const auto real = measure(
        torch::kCPU, [] { return memory::live_bytes(); }, [] { return memory::peak_bytes(); },
        [] { memory::reset_peak(); });
    memory::MetaCount count;
    memory::CpuMatmulWorkspaces workspaces(at::get_num_threads());
    const auto dry = measure(
        torch::kMeta, [&] { return count.live(); }, [&] { return count.peak(); }, [&] { count.reset_peak(); });
    EXPECT_GT(real.first, 0);
    EXPECT_EQ(dry.first, real.first) << torch::toString(dtype) << ": kept for backward";
    EXPECT_EQ(dry.second, real.second) << torch::toString(dtype) << ": peak";
  }
}

}  // namespace
}  // namespace composer

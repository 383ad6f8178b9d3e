// Tests that need a GPU (ctest label gpu). Where none is visible, or this build
// has no CUDA library, each reports itself skipped, not passed.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "models/float8.h"
#include "models/moe.h"
#include "parallelisms/comm/cuda_runtime.h"

namespace composer::parallel {
namespace {

CudaRuntime* gpu_or_skip(std::string& why) {
  CudaRuntime* cuda = cuda_runtime(why);
  if (cuda && cuda->device_count() == 0) {
    why = "no GPU is visible";
    return nullptr;
  }
  return cuda;
}

TEST(Gpu, LoadingTheCudaLibraryMakesLibTorchSeeTheGpu) {
  std::string why;
  CudaRuntime* cuda = gpu_or_skip(why);
  if (!cuda) GTEST_SKIP() << why;
  cuda->set_device(0);
  auto x = torch::arange(6, torch::kFloat).to(torch::Device(torch::kCUDA, 0));
  EXPECT_TRUE(x.is_cuda());
  EXPECT_EQ((x * 2).sum().item<float>(), 30.0f);
}

// NCCL at world size 1: the all-reduce of one rank is its input, the
// broadcast from rank 0 keeps it, and both run on the device.
TEST(Gpu, NcclCollectivesAtWorldSizeOne) {
  std::string why;
  CudaRuntime* cuda = gpu_or_skip(why);
  if (!cuda) GTEST_SKIP() << why;
  cuda->set_device(0);
  auto pg = cuda->nccl(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::seconds(60), 0);
  auto x = torch::arange(1000, torch::kFloat).to(torch::Device(torch::kCUDA, 0));
  std::vector<torch::Tensor> ts{x};
  pg->allreduce(ts)->wait();
  c10d::BroadcastOptions b;
  b.rootRank = 0;
  pg->broadcast(ts, b)->wait();
  cuda->synchronize(0);
  EXPECT_TRUE(torch::equal(x.cpu(), torch::arange(1000, torch::kFloat)));
  EXPECT_GT(cuda->peak_allocated(0), 0);
}

torch::Tensor bytes(const torch::Tensor& f8) { return f8.cpu().view(torch::kUInt8); }

// train.fp8's CUDA kernels (parallelisms/cuda/float8_kernels.cu) cast to the very bytes ATen's CPU
// ops give, packed (a multiple of 8 elements) and not (odd sizes), from float32 and bfloat16.
TEST(Gpu, Float8CastKernelGivesAtensBytes) {
  std::string why;
  CudaRuntime* cuda = gpu_or_skip(why);
  if (!cuda) GTEST_SKIP() << why;
  cuda->set_device(0);
  ASSERT_NE(nn::cuda_float8_kernels(), nullptr) << "loading the CUDA library registers the float8 kernels";
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (std::vector<int64_t> shape : {std::vector<int64_t>{64, 128}, std::vector<int64_t>{37, 53}}) {
      auto t = (torch::randn(shape) * 3).to(dtype);
      t.index_put_({0, 0}, 0.0);  // a zero, and values at the edge of the range through the scale
      for (auto f8 : {torch::kFloat8_e4m3fn, torch::kFloat8_e5m2}) {
        nn::Float8Tensor on_cpu = nn::to_float8(t, f8);
        nn::Float8Tensor on_gpu = nn::to_float8(t.cuda(), f8);
        EXPECT_TRUE(torch::equal(bytes(on_gpu.data), bytes(on_cpu.data))) << dtype << " " << f8 << " " << shape[1];
        EXPECT_TRUE(torch::equal(on_gpu.inv_scale.cpu(), on_cpu.inv_scale));
      }
    }
  }
}

// float8_linear on the GPU (cuBLAS's float8 matmuls and the transpose kernel in backward) against the
// same product of the dequantised operands in float64: within the float32 accumulation of float8
// products of the widths (forward with cuBLAS's fast accumulation).
TEST(Gpu, Float8LinearMatchesItsDequantisedProduct) {
  std::string why;
  CudaRuntime* cuda = gpu_or_skip(why);
  if (!cuda) GTEST_SKIP() << why;
  cuda->set_device(0);
  torch::manual_seed(1);
  auto x = torch::randn({4, 32, 64}, torch::kBFloat16).cuda().requires_grad_();
  auto w = (torch::randn({96, 64}) * 0.1).to(torch::kBFloat16).cuda().requires_grad_();
  auto g = torch::randn({4, 32, 96}, torch::kBFloat16).cuda();
  auto y = nn::float8_linear(x, w, torch::Tensor());
  y.backward(g);
  auto deq = [](const nn::Float8Tensor& t) { return t.data.cpu().to(torch::kDouble) * t.inv_scale.cpu().to(torch::kDouble); };
  auto x8 = deq(nn::to_float8(x.detach().reshape({-1, 64}).cpu(), torch::kFloat8_e4m3fn));
  auto w8 = deq(nn::to_float8(w.detach().cpu(), torch::kFloat8_e4m3fn));
  auto g8 = deq(nn::to_float8(g.reshape({-1, 96}).cpu(), torch::kFloat8_e5m2));
  auto close = [](const torch::Tensor& got, const torch::Tensor& want, const char* what) {
    const double err = (got.cpu().to(torch::kDouble).reshape(want.sizes()) - want).abs().max().item<double>();
    const double scale = want.abs().max().item<double>();
    // bfloat16 results: half a bfloat16 step (2^-9) of the largest value, and the accumulation's
    EXPECT_LE(err, scale * 4e-3) << what;
  };
  close(y.detach(), x8.mm(w8.t()), "y");
  close(x.grad(), g8.mm(w8), "dx");
  close(w.grad(), g8.t().mm(x8), "dw");
}

// The routed experts grouped on the GPU (at::_grouped_mm's bfloat16 kernel, one per projection)
// against the same experts one product each on the GPU (cuBLAS), from the same weights and rows,
// uneven groups and an expert given none: the output and every gradient within the per-expert
// path's own distance from a float64 reference (twice it, or one bfloat16 unit of the largest value).
TEST(Gpu, GroupedExpertsMatchThePerExpertProducts) {
  std::string why;
  CudaRuntime* cuda = gpu_or_skip(why);
  if (!cuda) GTEST_SKIP() << why;
  cuda->set_device(0);
  const std::vector<int64_t> counts = {37, 0, 5, 130, 1, 64, 19, 8};
  const int64_t dim = 64, hidden = 96;
  int64_t rows = 0;
  for (auto c : counts) rows += c;
  torch::manual_seed(2);
  const auto x0 = torch::randn({rows, dim}), g0 = torch::randn({rows, dim});
  const auto w10 = torch::randn({8, hidden, dim}) * 0.1, w20 = torch::randn({8, dim, hidden}) * 0.1,
             w30 = torch::randn({8, hidden, dim}) * 0.1;
  struct Out {
    std::vector<torch::Tensor> t;  // output, dx, dw1, dw2, dw3
  };
  auto run = [&](bool grouped, torch::Device device, torch::Dtype dtype) {
    models::GroupedExperts e(8, dim, hidden, grouped);
    e.to(device, dtype);
    {
      torch::NoGradGuard no_grad;
      e.w1.copy_(w10), e.w2.copy_(w20), e.w3.copy_(w30);
    }
    auto x = x0.to(device, dtype).requires_grad_();
    if (grouped) EXPECT_TRUE(e.grouped_kernel_holds(x));
    auto out = e.run(x, counts);
    out.backward(g0.to(device, dtype));
    Out o;
    for (const auto& t : {out.detach(), x.grad(), e.w1.grad(), e.w2.grad(), e.w3.grad()}) o.t.push_back(t.cpu().to(torch::kDouble));
    return o;
  };
  const torch::Device gpu(torch::kCUDA, 0);
  const Out ref = run(false, torch::kCPU, torch::kDouble), each = run(false, gpu, torch::kBFloat16),
            grouped = run(true, gpu, torch::kBFloat16);
  const char* names[] = {"output", "dx", "dw1", "dw2", "dw3"};
  for (size_t i = 0; i < ref.t.size(); ++i) {
    const double scale = ref.t[i].abs().max().item<double>();
    const double each_err = (each.t[i] - ref.t[i]).abs().max().item<double>();
    const double grouped_err = (grouped.t[i] - ref.t[i]).abs().max().item<double>();
    EXPECT_LE(grouped_err, std::max(2 * each_err, scale / 256)) << names[i] << ": per-expert " << each_err;
  }
}

}  // namespace
}  // namespace composer::parallel

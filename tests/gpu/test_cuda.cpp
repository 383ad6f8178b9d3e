// Tests that need a GPU (ctest label gpu). Where none is visible, or this build
// has no CUDA library, each reports itself skipped, not passed.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "models/float8.h"
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

}  // namespace
}  // namespace composer::parallel

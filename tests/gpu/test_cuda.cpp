// Tests that need a GPU (ctest label gpu). Where none is visible, or this build
// has no CUDA library, each reports itself skipped, not passed.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

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

}  // namespace
}  // namespace composer::parallel

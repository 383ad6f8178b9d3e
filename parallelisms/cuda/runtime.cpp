// libcomposer_cuda.so: composer's CudaRuntime over LibTorch's CUDA library and
// c10d's NCCL backend. composer loads it with dlopen (parallelisms/comm/cuda_runtime.cpp).
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "parallelisms/comm/cuda_runtime.h"

namespace composer::parallel {
namespace {

using c10::CachingAllocator::StatType;

class Runtime final : public CudaRuntime {
 public:
  int device_count() override { return c10::cuda::device_count(); }

  void set_device(int device) override { c10::cuda::set_device(static_cast<c10::DeviceIndex>(device)); }

  c10::intrusive_ptr<c10d::Backend> nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                          std::chrono::milliseconds timeout, int device) override {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
    // Connect now, so a bad setup fails at the rendezvous, not in the first step.
    pg->eagerConnectSingleDevice(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
    return pg;
  }

  int64_t peak_allocated(int device) override {
    return stats(device).allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  }
  int64_t peak_reserved(int device) override {
    return stats(device).reserved_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  }
  void reset_peaks(int device) override {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  }

  int64_t total_memory(int device) override {
    return static_cast<int64_t>(at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->totalGlobalMem);
  }

  void disable_tf32() override {
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }

  void synchronize(int device) override { c10::cuda::device_synchronize(); }

 private:
  static c10::CachingDeviceAllocator::DeviceStats stats(int device) {
    return c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  }
};

}  // namespace
}  // namespace composer::parallel

extern "C" __attribute__((visibility("default"))) composer::parallel::CudaRuntime* composer_cuda_runtime() {
  static composer::parallel::Runtime runtime;
  return &runtime;
}

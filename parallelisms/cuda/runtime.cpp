// libcomposer_cuda.so: composer's CudaRuntime over LibTorch's CUDA library and
// c10d's NCCL backend. composer loads it with dlopen (parallelisms/comm/cuda_runtime.cpp).
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "parallelisms/comm/cuda_runtime.h"
#ifdef COMPOSER_FLOAT8_KERNELS
#include "parallelisms/cuda/float8_kernels.h"
#endif

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

#ifdef COMPOSER_FLOAT8_KERNELS
  bool has_float8_kernels() override { return true; }

  void float8_cast(const at::Tensor& t, const at::Tensor& scale, at::Tensor& out) override {
    TORCH_CHECK(t.is_contiguous() && out.is_contiguous() && out.numel() == t.numel() && scale.scalar_type() == at::kFloat,
                "float8_cast: contiguous tensors of one size and a float32 scale");
    cuda::HighPrecision from;
    switch (t.scalar_type()) {
      case at::kFloat: from = cuda::HighPrecision::kFloat32; break;
      case at::kBFloat16: from = cuda::HighPrecision::kBFloat16; break;
      case at::kHalf: from = cuda::HighPrecision::kFloat16; break;
      default: TORCH_CHECK(false, "float8_cast: float32, bfloat16 or float16, not ", t.scalar_type());
    }
    TORCH_CHECK(out.scalar_type() == at::kFloat8_e4m3fn || out.scalar_type() == at::kFloat8_e5m2,
                "float8_cast: into e4m3fn or e5m2, not ", out.scalar_type());
    const auto to = out.scalar_type() == at::kFloat8_e4m3fn ? cuda::Float8Format::kE4m3 : cuda::Float8Format::kE5m2;
    cuda::cast_to_float8(t.data_ptr(), from, static_cast<uint8_t*>(out.data_ptr()), to, scale.data_ptr<float>(), t.numel(),
                         at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  void float8_transpose(const at::Tensor& t, at::Tensor& out) override {
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && out.is_contiguous() && t.element_size() == 1 &&
                    out.size(0) == t.size(1) && out.size(1) == t.size(0),
                "float8_transpose: a contiguous 2-D float8 tensor into its contiguous transpose");
    cuda::transpose_bytes(static_cast<const uint8_t*>(t.data_ptr()), static_cast<uint8_t*>(out.data_ptr()), t.size(0),
                          t.size(1), at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
#else
  bool has_float8_kernels() override { return false; }
  void float8_cast(const at::Tensor&, const at::Tensor&, at::Tensor&) override { TORCH_CHECK(false, "no float8 kernels"); }
  void float8_transpose(const at::Tensor&, at::Tensor&) override { TORCH_CHECK(false, "no float8 kernels"); }
#endif

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

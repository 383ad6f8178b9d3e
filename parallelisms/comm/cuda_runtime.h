// The CUDA side of composer. It lives in its own library, libcomposer_cuda.so
// (parallelisms/cuda/), which links LibTorch's CUDA library and NCCL and is
// loaded only by a job whose mesh.device is cuda: a CPU rank never maps them
// (linked in, they add 0.2 s to every rank's start and 350 MB to its memory).
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace composer::parallel {

class CudaRuntime {
 public:
  virtual ~CudaRuntime() = default;
  // GPUs this process sees (after CUDA_VISIBLE_DEVICES); 0 without a driver.
  virtual int device_count() = 0;
  // Makes cuda:`device` this process's current device.
  virtual void set_device(int device) = 0;
  // An NCCL process group of `size` ranks meeting through `store`, on cuda:`device`.
  virtual c10::intrusive_ptr<c10d::Backend> nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout, int device) = 0;
  // The caching allocator's peak allocated and reserved bytes on `device`
  // since the last reset_peaks.
  virtual int64_t peak_allocated(int device) = 0;
  virtual int64_t peak_reserved(int device) = 0;
  virtual void reset_peaks(int device) = 0;
  // The device's memory in bytes.
  virtual int64_t total_memory(int device) = 0;
  // float32 matmuls and convolutions in float32, not TF32 (parity runs).
  virtual void disable_tf32() = 0;
  virtual void synchronize(int device) = 0;
  // train.fp8's one-pass casts and transposes on the current stream (nn::Float8Kernels), where this
  // build compiled them.
  virtual bool has_float8_kernels() = 0;
  virtual void float8_cast(const at::Tensor& t, const at::Tensor& scale, at::Tensor& out) = 0;
  virtual void float8_transpose(const at::Tensor& t, at::Tensor& out) = 0;
};

// The runtime, loaded on first use. Load it before anything asks LibTorch
// about CUDA (seeding does): LibTorch settles whether CUDA exists on the first
// such question. Null when this build or this machine cannot load it; `why`
// then says what failed.
CudaRuntime* cuda_runtime(std::string& why);

}  // namespace composer::parallel

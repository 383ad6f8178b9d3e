#include "parallelisms/comm/cuda_runtime.h"

#include <dlfcn.h>

#include <mutex>

#include "models/float8.h"

namespace composer::parallel {
namespace {

// The runtime's kernels as the float8 layers ask for them.
class CudaFloat8Kernels final : public nn::Float8Kernels {
 public:
  explicit CudaFloat8Kernels(CudaRuntime* r) : r_(r) {}
  void cast(const torch::Tensor& t, const torch::Tensor& scale, torch::Tensor& out) override { r_->float8_cast(t, scale, out); }
  void transpose(const torch::Tensor& t, torch::Tensor& out) override { r_->float8_transpose(t, out); }

 private:
  CudaRuntime* r_;
};

}  // namespace

CudaRuntime* cuda_runtime(std::string& why) {
  static std::once_flag once;
  static CudaRuntime* runtime = nullptr;
  static std::string error;
  std::call_once(once, [] {
#ifdef COMPOSER_CUDA_LIBRARY
    void* lib = dlopen(COMPOSER_CUDA_LIBRARY, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      error = std::string("cannot load ") + COMPOSER_CUDA_LIBRARY + ": " + dlerror();
      return;
    }
    using Entry = CudaRuntime* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(lib, "composer_cuda_runtime"));
    if (!entry) {
      error = std::string(COMPOSER_CUDA_LIBRARY) + " has no entry point: " + dlerror();
      return;
    }
    runtime = entry();
    if (runtime->has_float8_kernels()) {
      static CudaFloat8Kernels kernels(runtime);
      nn::set_cuda_float8_kernels(&kernels);
    }
#else
    error = "this build of composer has no CUDA support (its LibTorch is not a CUDA build)";
#endif
  });
  why = error;
  return runtime;
}

}  // namespace composer::parallel

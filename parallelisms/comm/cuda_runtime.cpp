#include "parallelisms/comm/cuda_runtime.h"

#include <dlfcn.h>

#include <mutex>

#include "models/float8.h"

namespace composer::parallel {

// libcomposer_cuda.so's path, or "" in a build without CUDA (written by parallelisms/CMakeLists.txt).
extern const char* const kCudaLibrary;

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
    if (!*kCudaLibrary) {
      error = "this build of composer has no CUDA support (its LibTorch is not a CUDA build)";
      return;
    }
    void* lib = dlopen(kCudaLibrary, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      error = std::string("cannot load ") + kCudaLibrary + ": " + dlerror();
      return;
    }
    using Entry = CudaRuntime* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(lib, "composer_cuda_runtime"));
    if (!entry) {
      error = std::string(kCudaLibrary) + " has no entry point: " + dlerror();
      return;
    }
    runtime = entry();
    if (runtime->has_float8_kernels()) {
      static CudaFloat8Kernels kernels(runtime);
      nn::set_cuda_float8_kernels(&kernels);
    }
  });
  why = error;
  return runtime;
}

}  // namespace composer::parallel

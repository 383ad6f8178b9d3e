#include "parallelisms/comm/cuda_runtime.h"

#include <dlfcn.h>

#include <mutex>

namespace composer::parallel {

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
#else
    error = "this build of composer has no CUDA support (its LibTorch is not a CUDA build)";
#endif
  });
  why = error;
  return runtime;
}

}  // namespace composer::parallel

#include "parallelisms/cuda/float8_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>

namespace composer::cuda {
namespace {

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }

constexpr int kPack = 8;  // elements a thread converts at once: 16 bytes of bfloat16 in, 8 bytes out

template <class T>
struct alignas(sizeof(T) * kPack) Pack {
  T v[kPack];
};

template <class T, __nv_fp8_interpretation_t F>
__global__ void cast_kernel(const T* __restrict__ in, uint8_t* __restrict__ out, const float* __restrict__ scale,
                            int64_t n, bool packed) {
  const float s = *scale;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (packed) {  // n is a multiple of kPack and both pointers are aligned to a pack
    const int64_t packs = n / kPack;
    for (int64_t p = first; p < packs; p += step) {
      const Pack<T> x = reinterpret_cast<const Pack<T>*>(in)[p];
      uint2 y;
      __nv_fp8x2_storage_t* pairs = reinterpret_cast<__nv_fp8x2_storage_t*>(&y);
#pragma unroll
      for (int k = 0; k < kPack / 2; ++k) {
        pairs[k] = __nv_cvt_float2_to_fp8x2(make_float2(widen(x.v[2 * k]) * s, widen(x.v[2 * k + 1]) * s),
                                            __NV_SATFINITE, F);
      }
      reinterpret_cast<uint2*>(out)[p] = y;
    }
    return;
  }
  for (int64_t i = first; i < n; i += step) out[i] = __nv_cvt_float_to_fp8(widen(in[i]) * s, __NV_SATFINITE, F);
}

template <class T>
void launch_cast(const T* in, uint8_t* out, Float8Format to, const float* scale, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const bool packed = n % kPack == 0 && reinterpret_cast<uintptr_t>(in) % sizeof(Pack<T>) == 0 &&
                      reinterpret_cast<uintptr_t>(out) % sizeof(uint2) == 0;
  const int threads = 256;
  const int64_t work = packed ? n / kPack : n;
  const int blocks = static_cast<int>(std::min<int64_t>((work + threads - 1) / threads, 65536));
  if (to == Float8Format::kE4m3) {
    cast_kernel<T, __NV_E4M3><<<blocks, threads, 0, stream>>>(in, out, scale, n, packed);
  } else {
    cast_kernel<T, __NV_E5M2><<<blocks, threads, 0, stream>>>(in, out, scale, n, packed);
  }
}

constexpr int kTile = 64;

// One 64 x 64 tile a block: read along in's rows, written along out's rows, through shared memory.
__global__ void transpose_kernel(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int64_t rows, int64_t cols) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) tile[i][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += blockDim.y) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (c < cols && r < rows) out[c * rows + r] = tile[threadIdx.x][i];
  }
}

}  // namespace

void cast_to_float8(const void* in, HighPrecision from, uint8_t* out, Float8Format to, const float* scale, int64_t n,
                    cudaStream_t stream) {
  switch (from) {
    case HighPrecision::kFloat32: launch_cast(static_cast<const float*>(in), out, to, scale, n, stream); break;
    case HighPrecision::kBFloat16: launch_cast(static_cast<const __nv_bfloat16*>(in), out, to, scale, n, stream); break;
    case HighPrecision::kFloat16: launch_cast(static_cast<const __half*>(in), out, to, scale, n, stream); break;
  }
}

void transpose_bytes(const uint8_t* in, uint8_t* out, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 threads(kTile, 4);
  const dim3 blocks(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  transpose_kernel<<<blocks, threads, 0, stream>>>(in, out, rows, cols);
}

}  // namespace composer::cuda

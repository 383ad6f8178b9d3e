// train.fp8's casts on a GPU (models/float8.h), as plain CUDA kernels: one pass each, where ATen's
// ops take a non-vectorised pass with a per-element dtype switch (the scaled cast) or an uncoalesced
// strided copy (the float8 transpose).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace composer::cuda {

enum class HighPrecision { kFloat32, kBFloat16, kFloat16 };
enum class Float8Format { kE4m3, kE5m2 };

// out[i] = in[i] * *scale in float32, then rounded to the nearest float8 value (ties to even),
// saturating at the format's largest finite value; NaN stays NaN. n elements, both contiguous.
void cast_to_float8(const void* in, HighPrecision from, uint8_t* out, Float8Format to, const float* scale, int64_t n,
                    cudaStream_t stream);

// out (cols x rows) = the transpose of in (rows x cols), one byte an element, both row-major.
void transpose_bytes(const uint8_t* in, uint8_t* out, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace composer::cuda

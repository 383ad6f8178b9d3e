// Float8 training of Linear layers (train.fp8), tensorwise dynamic scaling as torchao's float8
// "tensorwise" recipe does it: each matmul's operands are cast to float8 with one scale per tensor,
// the scale being the format's largest finite value over the tensor's largest magnitude (its amax),
// and multiplied by at::_scaled_mm, which accumulates in float32 and returns the high-precision
// dtype. Forward: input and weight in e4m3 (3 mantissa bits, largest 448); backward: the output
// gradient in e5m2 (2 mantissa bits, largest 57344) against the e4m3 weight and input saved by
// forward. Forward keeps the float8 input and weight (one byte an element) for backward.
#pragma once
#include <functional>

#include <torch/torch.h>

namespace composer::nn {

// Which operand an amax belongs to, for a transform that holds a piece of it.
enum class Fp8Operand { kInput, kWeight, kGradOutput };

// Makes a local amax (a float32 scalar tensor) the whole tensor's, in place: a transform that shards
// the operand (tensor_parallel) takes the maximum over its group, so every piece is cast with the
// scale a single device would use. Null: the local tensor is the whole one.
using Fp8AmaxReduce = std::function<void(torch::Tensor& amax, Fp8Operand which)>;

// A tensor in float8 and the reciprocal of the scale it was cast with (float32, a scalar):
// data * inv_scale approximates the original.
struct Float8Tensor {
  torch::Tensor data;
  torch::Tensor inv_scale;
};

// Casts t (any floating dtype) to `f8` (kFloat8_e4m3fn or kFloat8_e5m2) with tensorwise scaling.
Float8Tensor to_float8(const torch::Tensor& t, c10::ScalarType f8, const Fp8AmaxReduce& reduce = {},
                       Fp8Operand which = Fp8Operand::kInput);

// y = linear(x, w, b) computed in float8 as above; y, the input gradient and the weight gradient
// have x's and w's dtypes. x is (..., in), w (out, in), b (out) or undefined.
torch::Tensor float8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                            const Fp8AmaxReduce& reduce = {});

// Kernels that do a float8 cast or transpose in one pass on a device (the CUDA side registers its own,
// parallelisms/cuda/); without them, ATen's ops compute the same values.
class Float8Kernels {
 public:
  virtual ~Float8Kernels() = default;
  // out (float8, contiguous, t's shape) = t * scale (a float32 scalar) rounded once, saturating; t contiguous.
  virtual void cast(const torch::Tensor& t, const torch::Tensor& scale, torch::Tensor& out) = 0;
  // out (cols x rows, contiguous) = the transpose of t (rows x cols, contiguous), float8.
  virtual void transpose(const torch::Tensor& t, torch::Tensor& out) = 0;
};
// Registers the kernels for CUDA tensors (null: none).
void set_cuda_float8_kernels(Float8Kernels* kernels);
Float8Kernels* cuda_float8_kernels();

}  // namespace composer::nn

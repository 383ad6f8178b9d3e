#include "models/float8.h"

namespace composer::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kE4m3Max = 448.0;
constexpr double kE5m2Max = 57344.0;
// The smallest amax a scale is taken from (torchao's EPS): an all-zero tensor casts to zeros.
constexpr double kMinAmax = 1e-12;

Float8Kernels* cuda_kernels = nullptr;

Float8Kernels* kernels_for(const torch::Tensor& t) { return t.is_cuda() ? cuda_kernels : nullptr; }

// t's transpose made contiguous (2-D float8).
torch::Tensor transposed(const torch::Tensor& t) {
  if (Float8Kernels* k = kernels_for(t)) {
    torch::Tensor out = at::empty({t.size(1), t.size(0)}, t.options());
    k->transpose(t, out);
    return out;
  }
  return t.t().contiguous();
}

// a @ b in float8: a row-major (m, k), b column-major (k, n), as cuBLAS's float8 kernels take them.
torch::Tensor scaled_mm(const Float8Tensor& a, const Float8Tensor& b, c10::ScalarType out, bool fast_accum) {
  if (a.data.is_meta()) {  // the estimate's dry run: the result's allocation
    return at::empty({a.data.size(0), b.data.size(1)}, a.data.options().dtype(out));
  }
  return at::_scaled_mm(a.data, b.data, a.inv_scale, b.inv_scale, c10::nullopt, c10::nullopt, out, fast_accum);
}

// The same float8 values laid out column-major (the transpose made contiguous, transposed back).
Float8Tensor column_major(const Float8Tensor& t) { return {transposed(t.data).t(), t.inv_scale}; }

struct Float8LinearFn : torch::autograd::Function<Float8LinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& b, int64_t reduce_ptr) {
    const auto* reduce = reinterpret_cast<const Fp8AmaxReduce*>(reduce_ptr);
    auto x2 = x.reshape({-1, x.size(-1)});
    Float8Tensor x8 = to_float8(x2, at::kFloat8_e4m3fn, *reduce, Fp8Operand::kInput);
    Float8Tensor w8 = to_float8(w, at::kFloat8_e4m3fn, *reduce, Fp8Operand::kWeight);
    // w8 is (out, in) row-major: its transpose is the column-major (in, out) operand.
    auto y = scaled_mm(x8, {w8.data.t(), w8.inv_scale}, x.scalar_type(), /*fast_accum=*/true);
    if (b) y = y + *b;
    ctx->save_for_backward({x8.data, x8.inv_scale, w8.data, w8.inv_scale});
    ctx->saved_data["reduce"] = reduce_ptr;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["bias"] = b.has_value();
    ctx->set_materialize_grads(false);
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return y.view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    auto saved = ctx->get_saved_variables();
    const Float8Tensor x8{saved[0], saved[1]}, w8{saved[2], saved[3]};
    const auto* reduce = reinterpret_cast<const Fp8AmaxReduce*>(ctx->saved_data["reduce"].toInt());
    auto g2 = grads[0].reshape({-1, w8.data.size(0)});
    Float8Tensor g8 = to_float8(g2, at::kFloat8_e5m2, *reduce, Fp8Operand::kGradOutput);
    torch::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) {  // (m, out) @ (out, in)
      const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
      gx = scaled_mm(g8, column_major(w8), dtype, /*fast_accum=*/false).view(ctx->saved_data["x_sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {  // (out, m) @ (m, in)
      const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["w_dtype"].toInt());
      gw = scaled_mm({transposed(g8.data), g8.inv_scale}, column_major(x8), dtype, /*fast_accum=*/false);
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) gb = g2.sum(0);
    return {gx, gw, gb, torch::Tensor()};
  }
};

const Fp8AmaxReduce& no_reduce() {
  static const Fp8AmaxReduce none;
  return none;
}

}  // namespace

void set_cuda_float8_kernels(Float8Kernels* kernels) { cuda_kernels = kernels; }
Float8Kernels* cuda_float8_kernels() { return cuda_kernels; }

Float8Tensor to_float8(const torch::Tensor& t, c10::ScalarType f8, const Fp8AmaxReduce& reduce, Fp8Operand which) {
  TORCH_CHECK(f8 == at::kFloat8_e4m3fn || f8 == at::kFloat8_e5m2, "to_float8: e4m3fn or e5m2, not ", f8);
  const double fmax = f8 == at::kFloat8_e4m3fn ? kE4m3Max : kE5m2Max;
  torch::NoGradGuard no_grad;
  // The largest magnitude in one pass over t (its min and max), in float32.
  auto [lo, hi] = at::aminmax(t);
  torch::Tensor amax = at::maximum(hi.to(at::kFloat), lo.to(at::kFloat).neg());
  if (reduce) reduce(amax, which);
  torch::Tensor scale = amax.clamp_min(kMinAmax).reciprocal().mul_(fmax);
  // t * scale is at most fmax in magnitude up to one rounding, which the cast rounds back to fmax
  // (a float8 overflow needs a value past fmax by half a step): no clamp is needed.
  // One kernel computing in float32: a one-element (not zero-dim) scale takes part in type promotion,
  // so a bfloat16 t is not multiplied in bfloat16 and rounded twice.
  torch::Tensor data = at::empty(t.sizes(), t.options().dtype(f8));
  Float8Kernels* k = kernels_for(t);
  if (k && t.is_contiguous()) {
    k->cast(t, scale, data);
  } else {
    at::mul_out(data, t, scale.reshape({1}));
  }
  return {data, scale.reciprocal()};
}

torch::Tensor float8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                            const Fp8AmaxReduce& reduce) {
  const Fp8AmaxReduce& r = reduce ? reduce : no_reduce();
  return Float8LinearFn::apply(x, w, b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt,
                               reinterpret_cast<int64_t>(&r));
}

}  // namespace composer::nn

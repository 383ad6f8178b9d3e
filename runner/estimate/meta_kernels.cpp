// Meta kernels (output shapes, no data) for the ATen operators composer's
// models use that LibTorch itself gives none (PyTorch registers them in
// Python), and for the matmuls, whose CPU kernels allocate scratch space
// LibTorch's meta kernels know nothing of (these replace them). A memory estimate runs a model on meta tensors (estimate.h); each
// kernel allocates exactly the storage its CPU kernel allocates (the outputs
// it returns, at their storage's size, and the temporaries it holds while it
// runs), so the counted bytes match a real run's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "runner/base/memory.h"

#include <tuple>

namespace composer {

void ensure_meta_kernels() {}  // referencing this file keeps its registrations in the link

namespace {

at::Tensor relu(const at::Tensor& self) { return at::empty_like(self); }

at::Tensor logical_or(const at::Tensor& self, const at::Tensor& other) {
  return at::empty(at::infer_size(self.sizes(), other.sizes()), self.options().dtype(at::kBool));
}

at::Tensor max_all(const at::Tensor& self) { return at::empty({}, self.options()); }  // max() over every element

at::Tensor index_select(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  auto shape = self.sizes().vec();
  if (!shape.empty()) shape[at::maybe_wrap_dim(dim, self.dim())] = index.numel();
  return at::empty(shape, self.options());
}

at::Tensor embedding_dense_backward(const at::Tensor& grad, const at::Tensor& /*indices*/, c10::SymInt num_weights,
                                    c10::SymInt /*padding_idx*/, bool /*scale_grad_by_freq*/) {
  return at::empty({num_weights.expect_int(), grad.size(-1)}, grad.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& /*weight*/, const std::optional<at::Tensor>& /*bias*/,
    const std::optional<at::Tensor>& /*running_mean*/, const std::optional<at::Tensor>& /*running_var*/,
    bool /*training*/, double /*momentum*/, double /*eps*/) {
  const int64_t c = input.dim() > 1 ? input.size(1) : 1;
  auto stats = input.options().dtype(input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  return {at::empty_like(input), at::empty({c}, stats), at::empty({c}, stats)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_batch_norm_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& /*running_mean*/, const std::optional<at::Tensor>& /*running_var*/,
    const std::optional<at::Tensor>& /*save_mean*/, const std::optional<at::Tensor>& /*save_invstd*/, bool /*train*/,
    double /*eps*/, std::array<bool, 3> mask) {
  const int64_t c = input.dim() > 1 ? input.size(1) : 1;
  auto param = weight && weight->defined() ? weight->options() : input.options();
  return {mask[0] ? at::empty_like(input) : at::Tensor(), mask[1] ? at::empty({c}, param) : at::Tensor(),
          mask[2] ? at::empty({c}, param) : at::Tensor()};
  (void)grad_out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_layer_norm_backward(
    const at::Tensor& /*grad_out*/, const at::Tensor& input, c10::SymIntArrayRef /*normalized_shape*/,
    const at::Tensor& /*mean*/, const at::Tensor& /*rstd*/, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> mask) {
  auto like = [](const std::optional<at::Tensor>& t) { return t && t->defined() ? at::empty_like(*t) : at::Tensor(); };
  return {mask[0] ? at::empty_like(input) : at::Tensor(), mask[1] ? like(weight) : at::Tensor(),
          mask[2] ? like(bias) : at::Tensor()};
}

// The CPU kernel is structured: its output is made the elementwise loss's
// size and a reduction resizes it to a scalar, keeping that storage; the
// reduction then sums a second elementwise loss, freed on return.
at::Tensor mse_loss(const at::Tensor& self, const at::Tensor& target, int64_t reduction) {
  const auto shape = at::infer_size(self.sizes(), target.sizes());
  const auto options = self.options().dtype(at::result_type(self, target));
  auto out = at::empty(shape, options);
  if (reduction == at::Reduction::None) return out;
  at::empty(shape, options);  // the elementwise loss the reduction reads
  return out.resize_({});
}

at::Tensor mse_loss_backward(const at::Tensor& /*grad*/, const at::Tensor& self, const at::Tensor& /*target*/,
                             int64_t /*reduction*/) {
  return at::empty_like(self);
}

// Matmuls: LibTorch's own meta kernels, plus the scratch space the CPU kernel
// takes for itself while it runs (memory::matmul_workspace_bytes), allocated
// after the result and freed before return, as the CPU kernel does.
at::Tensor matmul_result(memory::MatmulKind kind, const at::Tensor& a, const at::Tensor& b,
                         std::vector<int64_t> shape) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "expected m1 and m2 to have the same dtype, but got: ",
              a.scalar_type(), " != ", b.scalar_type());
  auto out = at::empty(shape, a.options());
  if (const int64_t ws = memory::matmul_workspace_bytes(kind, a, b)) at::empty({ws}, a.options().dtype(at::kByte));
  return out;
}

void check_2d(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2, "self must be a matrix");
  TORCH_CHECK(b.dim() == 2, "mat2 must be a matrix");
  TORCH_CHECK(a.size(1) == b.size(0), "mat1 and mat2 shapes cannot be multiplied (", a.size(0), "x", a.size(1),
              " and ", b.size(0), "x", b.size(1), ")");
}

void check_3d(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 3, "batch1 must be a 3D tensor");
  TORCH_CHECK(b.dim() == 3, "batch2 must be a 3D tensor");
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(2) == b.size(1), "Expected size for first two dimensions of batch2 ",
              "tensor to be: [", a.size(0), ", ", a.size(2), "] but got: [", b.size(0), ", ", b.size(1), "].");
}

at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
  check_2d(self, mat2);
  return matmul_result(memory::MatmulKind::kMm, self, mat2, {self.size(0), mat2.size(1)});
}

at::Tensor addmm(const at::Tensor& /*bias*/, const at::Tensor& mat1, const at::Tensor& mat2,
                 const at::Scalar& /*beta*/, const at::Scalar& /*alpha*/) {
  check_2d(mat1, mat2);
  return matmul_result(memory::MatmulKind::kAddmm, mat1, mat2, {mat1.size(0), mat2.size(1)});
}

at::Tensor bmm(const at::Tensor& self, const at::Tensor& mat2) {
  check_3d(self, mat2);
  return matmul_result(memory::MatmulKind::kBmm, self, mat2, {self.size(0), self.size(1), mat2.size(2)});
}

at::Tensor baddbmm(const at::Tensor& /*bias*/, const at::Tensor& batch1, const at::Tensor& batch2,
                   const at::Scalar& /*beta*/, const at::Scalar& /*alpha*/) {
  check_3d(batch1, batch2);
  return matmul_result(memory::MatmulKind::kBaddbmm, batch1, batch2, {batch1.size(0), batch1.size(1), batch2.size(2)});
}

// at::_grouped_mm (a mixture of experts' grouped products, rows [n, k] x weights [groups, k, m], or
// [m, n] x [n, k] giving [groups, m, k]): the result as ATen allocates it, its last dim padded to 16
// bytes, and the scratch of the CPU kernel's per-group matmuls, for a group of an even split of the
// rows (the dry run routes each expert the same rows).
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& offs,
                      const std::optional<at::Tensor>& /*bias*/, std::optional<at::ScalarType> /*out_dtype*/) {
  TORCH_CHECK(offs && offs->dim() == 1 && offs->size(0) > 0, "_grouped_mm: the offsets of each group's rows");
  const bool per_group = b.dim() == 2;  // [m, n] x [n, k]: the groups split n
  TORCH_CHECK(a.dim() == 2 && (per_group ? b.size(0) == a.size(1) : b.size(1) == a.size(1)),
              "_grouped_mm: shapes ", a.sizes(), " and ", b.sizes(), " cannot be multiplied");
  const int64_t groups = offs->size(0), last = b.size(-1);
  const int64_t align = 16 / static_cast<int64_t>(a.element_size()), padded = (last + align - 1) / align * align;
  auto out = per_group ? at::empty_strided({groups, a.size(0), last}, {a.size(0) * padded, padded, 1}, a.options())
                       : at::empty_strided({a.size(0), last}, {padded, 1}, a.options());
  const int64_t split = per_group ? a.size(1) : a.size(0), rows = (split + groups - 1) / groups;
  const int64_t ws = per_group ? memory::matmul_workspace_bytes(memory::MatmulKind::kMm, a.narrow(1, 0, rows),
                                                                b.narrow(0, 0, rows))
                               : memory::matmul_workspace_bytes(memory::MatmulKind::kMm, a.narrow(0, 0, rows), b[0]);
  if (ws) at::empty({ws}, a.options().dtype(at::kByte));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("mm", mm);
  m.impl("addmm", addmm);
  m.impl("bmm", bmm);
  m.impl("baddbmm", baddbmm);
  m.impl("_grouped_mm", grouped_mm);
  m.impl("relu", relu);
  m.impl("max", max_all);
  m.impl("logical_or", logical_or);
  m.impl("index_select", index_select);
  m.impl("embedding_dense_backward", embedding_dense_backward);
  m.impl("native_batch_norm", native_batch_norm);
  m.impl("native_batch_norm_backward", native_batch_norm_backward);
  m.impl("native_layer_norm_backward", native_layer_norm_backward);
  m.impl("mse_loss", mse_loss);
  m.impl("mse_loss_backward", mse_loss_backward);
}

}  // namespace composer

#include "models/layers.h"

#include <ATen/SDPBackend.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "models/saved_ops.h"

namespace composer::nn {
namespace {
// While a GpuKernelShapes lives on this thread: meta tensors (a cuda plan's
// dry run) stand for a GPU's kernels, whose allocations differ from the CPU's.
thread_local bool gpu_kernels = false;

// PyTorch's fused RMSNorm kernel's allocations on meta tensors: the output,
// and a float32 inverse RMS per row saved with the input and weight for
// backward, which returns the two gradients.
struct FusedRmsNormOnMeta : torch::autograd::Function<FusedRmsNormOnMeta> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w) {
    auto rows = x.sizes().vec();
    rows.back() = 1;
    ctx->save_for_backward({x, w, at::empty(rows, x.options().dtype(at::kFloat))});
    return at::empty_like(x);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    return {at::empty_like(saved[0]), at::empty_like(saved[1])};
  }
};
}  // namespace


Linear::Linear(int64_t in, int64_t out, bool with_bias, torch::Tensor tied_weight)
    : Module("Linear"), in_features(in), out_features(out) {
  if (tied_weight.defined()) {
    TORCH_INTERNAL_ASSERT(tied_weight.size(0) == out && tied_weight.size(1) == in);
    weight = register_parameter("weight", tied_weight);
  } else {
    weight = register_parameter(
        "weight", new_param({out, in}, [](torch::Tensor& w) { torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0)); }));
  }
  if (with_bias) {
    const double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
    bias = register_parameter("bias", new_param({out}, [bound](torch::Tensor& b) { torch::nn::init::uniform_(b, -bound, bound); }));
  }
}

namespace {

thread_local WeightGradRecords* active_records = nullptr;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether a 2-D tensor is column-major, as autograd's mm backward tests it to pick its matmul order.
bool column_major(const torch::Tensor& t) { return t.stride(0) == 1 && t.stride(1) == t.size(0); }

// y = linear(x, w, b) whose backward returns the input gradient only and
// records the output gradient in the LinearRecord (weight and bias get none
// here; WeightGradRecords::backward delivers theirs).
struct DeferredLinearFn : torch::autograd::Function<DeferredLinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& b, c10::intrusive_ptr<LinearRecord> record) {
    ctx->set_materialize_grads(false);  // an unused output: no gradient, nothing recorded
    torch::Tensor y = std::exchange(record->kept_output, torch::Tensor());  // forward's value, kept (op mode)
    if (!y.defined()) y = torch::linear(x, w, b);
    ctx->saved_data["record"] = c10::IValue::make_capsule(std::move(record));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto r = c10::static_intrusive_pointer_cast<LinearRecord>(ctx->saved_data["record"].toCapsule());
    const torch::Tensor& g = grads[0];
    torch::Tensor gx;
    if (g.defined()) {
      // A second backward through the node (retain_graph) adds up, as gradients would.
      r->grad_output = r->grad_output.defined() ? r->grad_output + g : g;
      if (ctx->needs_input_grad(0)) {
        // autograd's mm_mat1_backward on the flattened input, then back to the input's shape.
        const auto& w = r->weight;
        auto x2 = r->input.reshape({-1, w.size(1)});
        auto g2 = g.reshape({-1, w.size(0)});
        gx = column_major(x2) ? w.t().mm(g2.t()).t() : g2.mm(w);
        gx = gx.reshape(r->input.sizes());
      }
    }
    return {gx, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

DeferWeightGrads::DeferWeightGrads(WeightGradRecords* into) : previous_(active_records) {
  if (into) active_records = into;
}

DeferWeightGrads::~DeferWeightGrads() { active_records = previous_; }

WeightGradRecords* DeferWeightGrads::active() { return active_records; }

torch::Tensor linear_weight_grad(const torch::Tensor& w, const torch::Tensor& x2, const torch::Tensor& g2) {
  const bool wt_column_major = w.stride(1) == 1 && w.stride(0) == w.size(1);
  return wt_column_major ? g2.t().mm(x2) : x2.t().mm(g2).t();
}

void WeightGradRecords::backward() {
  std::vector<torch::Tensor> roots, grads;
  {
    torch::NoGradGuard no_grad;
    for (const auto& r : records_) {
      if (!r->grad_output.defined()) continue;  // the output got no gradient: neither do the parameters
      TORCH_CHECK(r->input._version() == r->input_version,
                  "a Linear's input was modified in place after its forward; its deferred weight gradient "
                  "cannot be computed");
      const auto& w = r->weight;
      auto x2 = r->input.reshape({-1, w.size(1)});
      auto g2 = r->grad_output.reshape({-1, w.size(0)});
      if (w.requires_grad()) {
        roots.push_back(w);
        grads.push_back(linear_weight_grad(w, x2, g2));
      }
      if (r->bias.defined() && r->bias.requires_grad()) {
        roots.push_back(r->bias);
        grads.push_back(at::sum_to(g2, r->bias.sizes()));
      }
    }
  }
  records_.clear();
  if (!roots.empty()) torch::autograd::backward(roots, grads);
}

// Op-mode activation checkpointing's replay (models/saved_ops.h): a kept
// output returned through a function with the op's own backward.
namespace {

// A kept tensor rides in a capsule: as an argument it would count as an input of the function.
struct Kept : torch::CustomClassHolder {
  std::vector<torch::Tensor> outputs;
};

struct KeptLinearFn : torch::autograd::Function<KeptLinearFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const c10::optional<torch::Tensor>& b, c10::intrusive_ptr<Kept> kept) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = b.has_value();
    return kept->outputs[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const torch::Tensor& g = grads[0];
    variable_list out(4);
    if (!g.defined()) return out;
    // autograd's mm backward on the flattened input, as torch::linear's graph computes it.
    auto x2 = x.reshape({-1, w.size(1)});
    auto g2 = g.reshape({-1, w.size(0)});
    if (ctx->needs_input_grad(0)) out[0] = (column_major(x2) ? w.t().mm(g2.t()).t() : g2.mm(w)).reshape(x.sizes());
    if (ctx->needs_input_grad(1)) out[1] = linear_weight_grad(w, x2, g2);
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) out[2] = g2.sum(0);
    return out;
  }
};

struct KeptAttentionFn : torch::autograd::Function<KeptAttentionFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool causal, c10::intrusive_ptr<Kept> kept) {
    ctx->save_for_backward({q, k, v, kept->outputs[0], kept->outputs[1]});
    ctx->saved_data["causal"] = causal;
    return kept->outputs[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    variable_list out(5);
    if (!grads[0].defined()) return out;
    if (s[0].is_meta()) {  // a dry run: the kernel's three gradients, by shape
      out[0] = at::empty_like(s[0]);
      out[1] = at::empty_like(s[1]);
      out[2] = at::empty_like(s[2]);
      return out;
    }
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], 0.0, ctx->saved_data["causal"].toBool());
    out[0] = gq;
    out[1] = gk;
    out[2] = gv;
    return out;
  }
};

c10::intrusive_ptr<Kept> kept_of(std::vector<torch::Tensor> outputs) {
  auto k = c10::make_intrusive<Kept>();
  k->outputs = std::move(outputs);
  return k;
}

torch::Tensor kept_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                          const torch::Tensor& y) {
  return KeptLinearFn::apply(x, w, b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt, kept_of({y}));
}

torch::Tensor kept_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                             const torch::Tensor& out, const torch::Tensor& logsumexp) {
  return KeptAttentionFn::apply(q, k, v, causal, kept_of({out, logsumexp}));
}

}  // namespace

void Linear::add_lora(int64_t rank, double alpha, double dropout) {
  lora_A = register_parameter(
      "lora_A", new_param({rank, in_features}, [](torch::Tensor& a) { torch::nn::init::kaiming_uniform_(a, std::sqrt(5.0)); }));
  lora_B = register_parameter("lora_B", new_param({out_features, rank}, [](torch::Tensor& b) { b.zero_(); }));
  lora_scaling = alpha / static_cast<double>(rank);
  lora_dropout = dropout;
}

torch::Tensor Linear::forward(torch::Tensor x) {
  torch::Tensor y = base_forward(x);
  if (!lora_A.defined()) return y;
  const torch::Tensor h = lora_dropout > 0 && is_training() ? torch::dropout(x, lora_dropout, /*train=*/true) : x;
  return y + torch::linear(torch::linear(h, param(lora_A)), param(lora_B)) * lora_scaling;
}

torch::Tensor Linear::base_forward(const torch::Tensor& x) {
  const torch::Tensor& w = param(weight);
  torch::Tensor b = bias.defined() && !bias_after ? param(bias) : torch::Tensor();
  WeightGradRecords* records = DeferWeightGrads::active();
  if (fp8 && !records) return float8_linear(x, w, b, fp8_amax);
  if (fused && !records) {
    auto y = fused(x, w, b);
    if (y.defined()) return y;
  }
  // Op-mode activation checkpointing (models/saved_ops.h): keep this matmul's output, or take it back.
  torch::Tensor kept;
  SavedOps* ops = fp8 || fused ? nullptr : SavedOps::active();
  if (ops && ops->wants(SavedOps::kLinear)) {
    if (ops->replaying()) {
      auto outputs = ops->take_next();
      if (!outputs.empty()) kept = outputs[0];
    } else if (ops->keep_next()) {
      auto y = torch::linear(x, w, b);
      ops->keep({y});
      return y;
    }
  }
  if (!records || !torch::GradMode::is_enabled() || !(w.requires_grad() || (b.defined() && b.requires_grad()))) {
    return kept.defined() ? kept_linear(x, w, b, kept) : torch::linear(x, w, b);
  }
  auto r = c10::make_intrusive<LinearRecord>();
  r->kept_output = kept;
  r->input = x.detach();  // its values (and version counter), not the graph behind it
  r->input_version = x._version();
  r->weight = w;
  r->bias = b;
  records->add(r);
  // An optional bias: LibTorch 1.13's custom functions reject undefined tensor arguments.
  return DeferredLinearFn::apply(x, w, b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt, std::move(r));
}

Embedding::Embedding(int64_t n, int64_t d) : Module("Embedding"), num_embeddings(n), embedding_dim(d) {
  weight = register_parameter("weight", new_param({n, d}, [](torch::Tensor& w) { torch::nn::init::normal_(w); }));
}

torch::Tensor Embedding::forward(torch::Tensor ids) { return torch::embedding(param(weight), ids); }

LayerNorm::LayerNorm(int64_t d, double e, bool with_bias) : Module("LayerNorm"), dim(d), eps(e) {
  weight = register_parameter("weight", new_param({d}, [](torch::Tensor& w) { w.fill_(1); }));
  if (with_bias) bias = register_parameter("bias", new_param({d}, [](torch::Tensor& b) { b.zero_(); }));
}

torch::Tensor LayerNorm::forward(torch::Tensor x) {
  return torch::layer_norm(x, {dim}, param(weight), bias.defined() ? param(bias) : torch::Tensor(),
                           eps);
}

RMSNorm::RMSNorm(int64_t d, double e) : Module("RMSNorm"), dim(d), eps(e) {
  weight = register_parameter("weight", new_param({d}, [](torch::Tensor& w) { w.fill_(1); }));
}

torch::Tensor RMSNorm::forward(torch::Tensor x) {
  auto w = param(weight);
  // On a GPU, PyTorch's fused kernel (F.rms_norm's, taken when the weight has
  // the input's dtype): one kernel each way, float32 inside and the result
  // rounded once; it keeps the input and a float32 inverse RMS per row for
  // backward, where the form below keeps a float32 copy of the input and the
  // normalised input too. On the CPU the form below, op for op the goldens'.
  if (w.scalar_type() == x.scalar_type()) {
    if (x.is_cuda()) return at::rms_norm(x, {dim}, w, eps);
    if (x.is_meta() && gpu_kernels) return FusedRmsNormOnMeta::apply(x, w);
  }
  auto xf = x.to(torch::kFloat);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * w;
}

void trunc_normal_(torch::Tensor t, double mean, double std, double a, double b) {
  torch::NoGradGuard no_grad;
  auto norm_cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  double l = norm_cdf((a - mean) / std), u = norm_cdf((b - mean) / std);
  t.uniform_(2 * l - 1, 2 * u - 1);
  t.erfinv_();
  t.mul_(std * std::sqrt(2.0));
  t.add_(mean);
  t.clamp_(a, b);
}

}  // namespace composer::nn

namespace composer::nn {
namespace {

// A fused kernel's allocations on meta tensors: the output, laid out (batch, seq, heads, head_dim)
// and returned transposed as the flash kernels of both devices do (so the caller's transpose back
// and contiguous() copy nothing), and a float32 log-sum-exp per query row, saved with q, k and v for
// backward; backward returns the three gradients, and on a GPU also fills a float32 accumulator of
// the query's gradient (see GpuKernelShapes).
struct FusedAttentionOnMeta : torch::autograd::Function<FusedAttentionOnMeta> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
    const int64_t b = q.size(0), h = q.size(1), s = q.size(2);
    auto out = at::empty({b, s, h, v.size(-1)}, q.options()).transpose(1, 2);
    auto logsumexp = at::empty({b, h, s}, q.options().dtype(at::kFloat));
    ctx->save_for_backward({q, k, v, out, logsumexp});
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    torch::Tensor accumulator;
    if (gpu_kernels) accumulator = at::empty(saved[0].sizes(), saved[0].options().dtype(at::kFloat));
    return {at::empty_like(saved[0]), at::empty_like(saved[1]), at::empty_like(saved[2])};
  }
};
}  // namespace

GpuKernelShapes::GpuKernelShapes(bool on) : previous_(gpu_kernels) { gpu_kernels = on; }
GpuKernelShapes::~GpuKernelShapes() { gpu_kernels = previous_; }

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        bool causal, double dropout_p, bool training, const torch::Tensor& mask) {
  // LibTorch's scaled_dot_product_attention on every device; the PyTorch reference calls the same
  // function, so both sides run the same kernel. It picks a fused kernel that never materialises the
  // scores: on a GPU flash or memory-efficient attention, on the CPU its flash kernel, which the CPU
  // takes only without dropout (with dropout it falls back to matmul, softmax, dropout, matmul).
  const double p = training ? dropout_p : 0.0;
  // Op-mode activation checkpointing (models/saved_ops.h) keeps the CPU flash kernel's output and
  // log-sum-exp, or takes them back; on meta, tensors of their shapes.
  SavedOps* ops = SavedOps::active();
  const bool keepable =
      ops && ops->wants(SavedOps::kAttention) && p == 0.0 && !mask.defined() &&
      (q.is_meta() ? !gpu_kernels
                   : q.device().is_cpu() && at::_fused_sdp_choice(q, k, v, {}, 0.0, causal) ==
                                                static_cast<int64_t>(at::SDPBackend::flash_attention));
  if (keepable && ops->replaying()) {
    auto kept = ops->take_next();
    if (!kept.empty()) return kept_attention(q, k, v, causal, kept[0], kept[1]);
  } else if (keepable && ops->keep_next()) {
    torch::Tensor out, logsumexp;
    if (q.is_meta()) {
      out = at::empty({q.size(0), q.size(2), q.size(1), v.size(-1)}, q.options()).transpose(1, 2);
      logsumexp = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    } else {
      std::tie(out, logsumexp) = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
    }
    ops->keep({out, logsumexp});
    return out;
  }
  if (q.is_meta()) {
    if (gpu_kernels || p == 0.0) return FusedAttentionOnMeta::apply(q, k, v);
    // The CPU's fallback under dropout, spelled out in ops the meta device has kernels for (LibTorch's
    // math path uses one it lacks): it keeps the scores, probabilities and dropout mask for backward.
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
    if (mask.defined()) {
      scores = scores.masked_fill(mask.bitwise_not(), -std::numeric_limits<double>::infinity());
    } else if (causal) {
      auto mask = torch::ones({q.size(-2), k.size(-2)}, q.options().dtype(torch::kBool)).triu(1);
      scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
    }
    return torch::matmul(torch::dropout(torch::softmax(scores, -1), p, true), v);
  }
  if (mask.defined()) return at::scaled_dot_product_attention(q, k, v, mask, p, false);
  return at::scaled_dot_product_attention(q, k, v, {}, p, causal);
}
}  // namespace composer::nn

namespace composer::nn {

BatchNorm1d::BatchNorm1d(int64_t n, double e, double m) : Module("BatchNorm1d"), num_features(n), eps(e), momentum(m) {
  weight = register_parameter("weight", torch::ones({n}, param_options()));
  bias = register_parameter("bias", torch::zeros({n}, param_options()));
  running_mean = register_buffer("running_mean", torch::zeros({n}, param_options()));
  running_var = register_buffer("running_var", torch::ones({n}, param_options()));
  num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, param_options().dtype(torch::kLong)));
}

torch::Tensor BatchNorm1d::forward(torch::Tensor x) {
  TORCH_CHECK(x.dim() >= 2 && x.size(1) == num_features, "BatchNorm1d(", num_features, ") got input of shape ",
              x.sizes(), ": dim 1 must have ", num_features, " features");
  if (is_training()) {
    torch::NoGradGuard no_grad;
    num_batches_tracked.add_(1);
  }
  // at::batch_norm updates running_mean and running_var in place in training mode (unbiased variance). It
  // computes in the statistics' dtype: under a 16-bit param_dtype the input, weight and bias are cast up and
  // the output back (no-ops when every dtype is the same).
  const auto dtype = running_mean.scalar_type();
  return torch::batch_norm(x.to(dtype), param(weight).to(dtype), param(bias).to(dtype), running_mean, running_var,
                           is_training(), momentum, eps, /*cudnn_enabled=*/false)
      .to(x.scalar_type());
}

void BatchNorm1d::to(torch::Dtype dtype, bool non_blocking) {
  Module::to(dtype, non_blocking);
  num_batches_tracked.set_data(num_batches_tracked.to(torch::kLong));
}

MultiheadAttention::MultiheadAttention(int64_t e, int64_t h, double p, int64_t kv_len)
    : Module("MultiheadAttention"), embed_dim(e), num_heads(h), key_value_len(kv_len), dropout(p) {
  in_proj_weight = register_parameter("in_proj_weight", torch::empty({3 * e, e}, param_options()));
  in_proj_bias = register_parameter("in_proj_bias", torch::zeros({3 * e}, param_options()));
  out_proj = add("out_proj", std::make_shared<Linear>(e, e));
  torch::NoGradGuard no_grad;
  torch::nn::init::xavier_uniform_(in_proj_weight);
  out_proj->bias.zero_();
}

torch::Tensor MultiheadAttention::forward(torch::Tensor x) {
  const torch::Tensor& w = param(in_proj_weight);
  const torch::Tensor& b = param(in_proj_bias);
  torch::Tensor q, k, v;
  if (key_value_len == 0) {  // one packed projection, as PyTorch does when query, key and value are one tensor
    auto qkv = torch::linear(x, w, b).chunk(3, -1);
    q = qkv[0], k = qkv[1], v = qkv[2];
  } else {  // the query projection, then one for key and value together
    const int64_t lq = x.size(0) - key_value_len;
    q = torch::linear(x.narrow(0, 0, lq), w.narrow(0, 0, embed_dim), b.narrow(0, 0, embed_dim));
    auto kv = torch::linear(x.narrow(0, lq, key_value_len), w.narrow(0, embed_dim, 2 * embed_dim),
                            b.narrow(0, embed_dim, 2 * embed_dim))
                  .chunk(2, -1);
    k = kv[0], v = kv[1];
  }
  const int64_t lq = q.size(0), batch = q.size(1), hd = embed_dim / num_heads;
  // (seq, batch, embed) -> (batch, heads, seq, head_dim)
  auto heads = [&](const torch::Tensor& t) { return t.reshape({t.size(0), batch * num_heads, hd}).transpose(0, 1)
                                                .view({batch, num_heads, t.size(0), hd}); };
  auto out = attention(heads(q), heads(k), heads(v), /*causal=*/false, dropout, is_training());
  out = out.permute({2, 0, 1, 3}).contiguous().view({batch * lq, embed_dim});
  return (*out_proj)(out).view({lq, batch, embed_dim});
}

}  // namespace composer::nn

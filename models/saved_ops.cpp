#include "models/saved_ops.h"

#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

#include "models/layers.h"

namespace composer::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

thread_local SavedOps* active_ops = nullptr;

// Whether a 2-D tensor is column-major, as autograd's mm backward tests it to pick its matmul order.
bool column_major(const torch::Tensor& t) { return t.stride(0) == 1 && t.stride(1) == t.size(0); }

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

}  // namespace

SavedOps::Scope::Scope(SavedOps* ops, bool replay) : previous_(active_ops) {
  if (!ops) return;
  ops->replay_ = replay;
  ops->next_ = 0;
  active_ops = ops;
}

SavedOps::Scope::~Scope() { active_ops = previous_; }

SavedOps* SavedOps::active() { return active_ops; }

bool SavedOps::keep_next() {
  const bool keep = (static_cast<int64_t>(next_) + 1) % every_ == 0;
  ++next_;
  kept_.emplace_back();
  return keep;
}

void SavedOps::keep(std::vector<torch::Tensor> outputs) {
  TORCH_INTERNAL_ASSERT(!kept_.empty());
  kept_.back() = std::move(outputs);
}

std::vector<torch::Tensor> SavedOps::take_next() {
  TORCH_CHECK(next_ < kept_.size(), "activation checkpointing (op): the recompute reached more kept-kind ops (",
              next_ + 1, ") than the forward did (", kept_.size(), ")");
  auto outputs = std::move(kept_[next_++]);
  if (!outputs.empty()) ++taken_;
  return outputs;
}

torch::Tensor kept_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                          const torch::Tensor& y) {
  return KeptLinearFn::apply(x, w, b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt, kept_of({y}));
}

torch::Tensor kept_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                             const torch::Tensor& out, const torch::Tensor& logsumexp) {
  return KeptAttentionFn::apply(q, k, v, causal, kept_of({out, logsumexp}));
}

}  // namespace composer::nn

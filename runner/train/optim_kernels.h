// The element-wise arithmetic of one optimizer step over float32 arrays, in
// one pass where torch.optim's single-tensor path makes one pass per
// operation. Each element is computed as ATen's CPU kernels compute it, rounding
// for rounding (exp_avg by fused multiply-add as lerp does, the second moment
// by addcmul's fused multiply-add, the update by addcdiv's (s * m) / d). SGD
// is bit-identical to that path. Adam's one difference is sqrt(exp_avg_sq):
// here the processor's, correctly rounded; ATen's CPU sqrt is MKL's vector
// sqrt, which is within one ulp but not always the nearest float (about 1 in
// 6), and runs at a fifth of the speed. tests/unit/test_optim.cpp checks both.
// No LibTorch here: this file is compiled without floating-point contraction,
// so that only the fused multiply-adds written out are fused.
#pragma once
#include <cstdint>

namespace composer::kernels {

// Adam and AdamW, as float32 scalars the way ATen casts them.
struct AdamStep {
  float decay = 1;          // AdamW: 1 - lr * weight_decay (1: none)
  float l2 = 0;             // Adam: weight_decay, added to the gradient
  float lerp_weight = 0;    // 1 - beta1
  float beta2 = 0;
  float one_minus_beta2 = 0;
  float bias_correction2_sqrt = 1;
  float eps = 0;
  float neg_step_size = 0;  // -lr / (1 - beta1^step)
};

// One Adam(W) step on n elements: decays p (AdamW), moves m and v, updates p.
void adam(float* p, const float* g, float* m, float* v, int64_t n, const AdamStep& s);

struct SgdStep {
  float l2 = 0;                   // weight_decay
  float momentum = 0;             // 0: no buffer
  float one_minus_dampening = 1;
  bool nesterov = false;
  bool first = false;             // the buffer starts as the gradient
  float neg_lr = 0;
};

// One SGD step on n elements; buf is read (unless first) and written when momentum != 0.
void sgd(float* p, const float* g, float* buf, int64_t n, const SgdStep& s);

}  // namespace composer::kernels

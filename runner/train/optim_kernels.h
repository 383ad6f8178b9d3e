// The element-wise arithmetic of one Adam or AdamW step over float32 arrays,
// in one pass where torch.optim's single-tensor path makes one pass per
// operation. Each element is computed as ATen's CPU kernels compute it, rounding
// for rounding (exp_avg by fused multiply-add as lerp does, the second moment
// by addcmul's fused multiply-add, the update by addcdiv's (s * m) / d). The
// one difference is sqrt(exp_avg_sq): here the processor's, correctly
// rounded; ATen's CPU sqrt is MKL's vector sqrt, which is within one ulp but
// not always the nearest float (about 1 in 6), and runs at a fifth of the
// speed. tests/unit/test_optim.cpp checks both. (SGD keeps the single-tensor
// path: its three passes over a parameter stay in cache, and one fused pass
// measured slower, 15.2 against 11.4 ms for 27M parameters.)
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

}  // namespace composer::kernels

#include "runner/train/optim_kernels.h"

#include <cmath>

namespace composer::kernels {
namespace {

// The bodies, instantiated once for CPUs with FMA and AVX2 (vectorised
// fused multiply-adds) and once for any x86-64 (std::fma in software).
#define COMPOSER_KERNEL_BODIES                                                                         \
  static void adam_impl(float* __restrict p, const float* __restrict g, float* __restrict m,           \
                        float* __restrict v, int64_t n, const AdamStep& s) {                          \
    const float decay = s.decay, l2 = s.l2, w = s.lerp_weight, b2 = s.beta2, c2 = s.one_minus_beta2; \
    const float bc = s.bias_correction2_sqrt, eps = s.eps, step = s.neg_step_size;                   \
    const bool small = std::fabs(w) < 0.5f;                                                           \
    const float coeff = small ? w : w - 1.0f;                                                         \
    for (int64_t i = 0; i < n; ++i) {                                                                 \
      const float pi = p[i];                                                                          \
      const float gi = l2 != 0.0f ? std::fma(pi, l2, g[i]) : g[i];                                    \
      const float pd = decay != 1.0f ? pi * decay : pi;                                               \
      const float mi = std::fma(coeff, gi - m[i], small ? m[i] : gi);                                 \
      const float vi = std::fma(c2 * gi, gi, v[i] * b2);                                              \
      m[i] = mi;                                                                                      \
      v[i] = vi;                                                                                      \
      const float denom = std::sqrt(vi) / bc + eps;                                                   \
      p[i] = pd + (step * mi) / denom;                                                                \
    }                                                                                                 \
  }

namespace generic {
COMPOSER_KERNEL_BODIES
}  // namespace generic

#if defined(__x86_64__)
namespace fma_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
COMPOSER_KERNEL_BODIES
#pragma GCC pop_options
}  // namespace fma_avx2

bool has_fma() {
  static const bool yes = __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
  return yes;
}
#else
// Elsewhere (aarch64) the base instruction set has vector fused multiply-adds.
namespace fma_avx2 = generic;
bool has_fma() { return false; }
#endif

#undef COMPOSER_KERNEL_BODIES

}  // namespace

void adam(float* p, const float* g, float* m, float* v, int64_t n, const AdamStep& s) {
  has_fma() ? fma_avx2::adam_impl(p, g, m, v, n, s) : generic::adam_impl(p, g, m, v, n, s);
}

}  // namespace composer::kernels

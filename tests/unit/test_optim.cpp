// The optimizers' fused CPU step (runner/train/optim_kernels.h) against
// torch.optim's single-tensor arithmetic spelled out with ATen operations,
// over 4 steps, for sizes around the kernels' block and vector widths, on one
// and on two threads. SGD (the single-tensor path on every device): every
// parameter and momentum buffer equal bit for bit. Adam and AdamW: bit for
// bit with sqrt correctly rounded (computed in
// float64 and rounded, which is exact for a square root), and within one ulp
// of the parameter per step of torch.optim's own arithmetic, whose CPU sqrt
// (MKL's) is not always the nearest float.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "runner/train/optim.h"

namespace composer {
namespace {

const int64_t kSizes[] = {1, 7, 8, 33, 16383, 16384, 16385, 50001};

std::vector<torch::Tensor> make_params(torch::Dtype dtype = torch::kFloat) {
  torch::manual_seed(1);
  std::vector<torch::Tensor> ps;
  for (int64_t n : kSizes) ps.push_back(torch::randn({n}, dtype));
  return ps;
}

// The gradient of step t for parameter i: varied magnitudes, some exact zeros.
torch::Tensor grad_of(const torch::Tensor& p, int step, size_t i) {
  torch::manual_seed(100 * step + static_cast<int64_t>(i));
  auto g = torch::randn_like(p) * std::pow(10.0, -static_cast<double>(i % 4));
  return g * (torch::rand_like(p) > 0.1).to(p.scalar_type());
}

// torch.optim.Adam/AdamW, single-tensor path (torch/optim/adam.py, _single_tensor_adam).
struct AdamRef {
  double lr, beta1, beta2, eps, wd;
  bool decoupled;
  bool nearest_sqrt;  // sqrt rounded to the nearest float, as the fused kernel rounds it; else ATen's
  std::vector<torch::Tensor> m, v;
  void step(std::vector<torch::Tensor>& ps, int t) {
    for (size_t i = 0; i < ps.size(); ++i) {
      auto& p = ps[i];
      auto g = grad_of(p, t, i);
      if (m.size() <= i) {
        m.push_back(torch::zeros_like(p));
        v.push_back(torch::zeros_like(p));
      }
      if (wd != 0) {
        if (decoupled) p.mul_(1 - lr * wd);
        else g = g.add(p, wd);
      }
      m[i].lerp_(g, 1 - beta1);
      v[i].mul_(beta2).addcmul_(g, g, 1 - beta2);
      const double step_size = lr / (1 - std::pow(beta1, t));
      const double bc2_sqrt = std::pow(1 - std::pow(beta2, t), 0.5);
      auto root = nearest_sqrt ? v[i].to(torch::kDouble).sqrt().to(torch::kFloat) : v[i].sqrt();
      auto denom = (root / bc2_sqrt).add_(eps);
      p.addcdiv_(m[i], denom, -step_size);
    }
  }
};

// torch.optim.SGD, single-tensor path (_single_tensor_sgd).
struct SgdRef {
  double lr, momentum, dampening, wd;
  bool nesterov;
  std::vector<torch::Tensor> buf;
  void step(std::vector<torch::Tensor>& ps, int t) {
    for (size_t i = 0; i < ps.size(); ++i) {
      auto& p = ps[i];
      auto g = grad_of(p, t, i);
      if (wd != 0) g = g.add(p, wd);
      if (momentum != 0) {
        if (buf.size() <= i) {
          buf.push_back(g.clone());
        } else {
          buf[i].mul_(momentum).add_(g, 1 - dampening);
        }
        g = nesterov ? g.add(buf[i], momentum) : buf[i];
      }
      p.add_(g, -lr);
    }
  }
};

void expect_bitwise(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const int64_t differ = a.ne(b).sum().item<int64_t>();
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << a.numel() << " elements differ, max "
                       << (a - b).abs().max().item<double>();
}

// |a - b| <= steps x (one ulp of b + `slack`), element by element.
void expect_within_ulps(const torch::Tensor& a, const torch::Tensor& b, int steps, double slack,
                        const std::string& what) {
  auto ulp = torch::nextafter(b.abs(), torch::full_like(b, INFINITY)) - b.abs();
  const int64_t outside = ((a - b).abs() > (ulp + slack) * steps).sum().item<int64_t>();
  EXPECT_EQ(outside, 0) << what << ": " << outside << " of " << a.numel() << " elements further apart than "
                        << steps << " x (an ulp + " << slack << ")";
}

// Runs 4 steps of composer's optimizer on fresh parameters and of `ref` on
// another copy; compares parameters and state after each, bit for bit, or
// with `slack` > 0 only the parameters, within an ulp + slack per step.
template <class Ref>
void compare(const OptimizerConfig& c, Ref ref, const std::vector<std::string>& state, const std::string& what,
             torch::Dtype dtype = torch::kFloat, double slack = 0) {
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    auto ours = make_params(dtype);
    auto theirs = make_params(dtype);
    for (auto& p : ours) p.set_requires_grad(true);
    auto opt = make_optimizer(c, ours);
    Ref r = ref;
    for (int t = 1; t <= 4; ++t) {
      for (size_t i = 0; i < ours.size(); ++i) ours[i].mutable_grad() = grad_of(ours[i].detach(), t, i);
      opt->step();
      r.step(theirs, t);
      const std::string at = what + ", " + std::to_string(threads) + " threads, step " + std::to_string(t);
      for (size_t i = 0; i < ours.size(); ++i) {
        if (slack > 0) {
          expect_within_ulps(ours[i].detach(), theirs[i], t, slack, at + ", param of " + std::to_string(kSizes[i]));
          continue;
        }
        expect_bitwise(ours[i].detach(), theirs[i], at + ", param of " + std::to_string(kSizes[i]));
        auto* s = opt->state_of(ours[i]);
        ASSERT_NE(s, nullptr);
        for (size_t k = 0; k < state.size(); ++k) {
          const auto& mine = s->tensors.at(state[k]);
          const auto& want = k == 0 ? r.first_state(i) : r.second_state(i);
          expect_bitwise(mine, want, at + ", " + state[k] + " of " + std::to_string(kSizes[i]));
        }
      }
    }
  }
  at::set_num_threads(1);
}

struct AdamCase : AdamRef {
  const torch::Tensor& first_state(size_t i) const { return m[i]; }
  const torch::Tensor& second_state(size_t i) const { return v[i]; }
};
struct SgdCase : SgdRef {
  const torch::Tensor& first_state(size_t i) const { return buf[i]; }
  const torch::Tensor& second_state(size_t i) const { return buf[i]; }
};

// AdamW at lr 0.01 with weight decay 0.05, and torch.optim's arithmetic for it (ATen's sqrt).
OptimizerConfig adamw() {
  OptimizerConfig c;
  c.name = OptimizerKind::kAdamW;
  c.lr = 0.01;
  c.weight_decay = 0.05;
  return c;
}
AdamCase adamw_reference(const OptimizerConfig& c) {
  AdamCase ref;
  static_cast<AdamRef&>(ref) = AdamRef{c.lr, c.betas[0], c.betas[1], c.eps, c.weight_decay, true, false, {}, {}};
  return ref;
}

TEST(FusedOptimizer, AdamAndAdamWMatchTheSingleTensorPathBitForBitWithTheNearestSqrt) {
  for (bool decoupled : {false, true}) {
    for (double wd : {0.0, 0.05}) {
      for (double beta1 : {0.9, 0.3}) {  // lerp's two formulas: weight below and above 0.5
        OptimizerConfig c;
        c.name = decoupled ? OptimizerKind::kAdamW : OptimizerKind::kAdam;
        c.lr = 0.01;
        c.weight_decay = wd;
        c.betas = {beta1, 0.999};
        AdamCase ref;
        static_cast<AdamRef&>(ref) = AdamRef{c.lr, beta1, 0.999, c.eps, wd, decoupled, true, {}, {}};
        compare(c, ref, {"exp_avg", "exp_avg_sq"},
                std::string(decoupled ? "adamw" : "adam") + " wd " + std::to_string(wd) + " beta1 " +
                    std::to_string(beta1));
      }
    }
  }
}

// Against torch.optim's arithmetic as it runs (ATen's sqrt): a sqrt one ulp
// (2^-23 relative) off moves the denominator, and so the update, by at most
// 2^-23 of itself, and the division rounds once more (another 2^-23); the
// update is lr x |m^| / sqrt(v^) <= 4 lr for these gradients. So each step
// moves the parameter by at most 4 lr x 2^-22 = lr x 2^-20 more, and may round
// it to the neighbouring float: an ulp + lr x 2^-20 per step.
TEST(FusedOptimizer, AdamWIsWithinAnUlpPerStepOfTorchOptim) {
  const OptimizerConfig c = adamw();
  compare(c, adamw_reference(c), {}, "adamw against ATen's sqrt", torch::kFloat, c.lr * std::ldexp(1.0, -20));
}

// The GPU's path (ATen's fused Adam and AdamW kernels, torch.optim's
// fused=True) run on the CPU against torch.optim's single-tensor arithmetic:
// the kernel spells the moments and the decay in its own order (beta1 x m +
// (1 - beta1) x g, not lerp; p - lr x wd x p, not p x (1 - lr x wd)), each
// within an ulp of them; the bound on the parameters is the test above's. A
// wrong argument (a beta, eps, the step, the decay's form) moves the update by
// far more than lr x 2^-20.
TEST(FusedOptimizer, AtenFusedStepOfTheGpuIsWithinAnUlpPerStepOfTorchOptim) {
  for (bool decoupled : {false, true}) {
    for (double wd : {0.0, 0.05}) {
      const double lr = 0.01;
      AdamRef ref{lr, 0.9, 0.999, 1e-8, wd, decoupled, false, {}, {}};
      auto ours = make_params(), theirs = make_params();
      std::vector<torch::Tensor> m, v;
      for (auto& p : ours) {
        m.push_back(torch::zeros_like(p));
        v.push_back(torch::zeros_like(p));
      }
      for (int t = 1; t <= 4; ++t) {
        std::vector<torch::Tensor> grads;
        for (size_t i = 0; i < ours.size(); ++i) grads.push_back(grad_of(ours[i], t, i));
        adam_step_fused_aten(ours, grads, m, v, std::vector<int64_t>(ours.size(), t), lr, 0.9, 0.999, 1e-8, wd,
                             decoupled);
        ref.step(theirs, t);
        for (size_t i = 0; i < ours.size(); ++i) {
          expect_within_ulps(ours[i], theirs[i], t, lr * std::ldexp(1.0, -20),
                             std::string(decoupled ? "adamw" : "adam") + " wd " + std::to_string(wd) + ", step " +
                                 std::to_string(t) + ", param of " + std::to_string(kSizes[i]));
        }
      }
    }
  }
}

TEST(FusedOptimizer, SgdIsTheSingleTensorPathBitForBit) {
  struct Opts {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (Opts o : {Opts{0, 0, 0, false}, Opts{0, 0, 0.01, false}, Opts{0.9, 0, 0, false}, Opts{0.9, 0.1, 0.01, false},
                 Opts{0.9, 0, 0.01, true}}) {
    OptimizerConfig c;
    c.name = OptimizerKind::kSgd;
    c.lr = 0.1;
    c.momentum = o.momentum;
    c.dampening = o.dampening;
    c.weight_decay = o.wd;
    c.nesterov = o.nesterov;
    SgdCase ref;
    static_cast<SgdRef&>(ref) = SgdRef{c.lr, o.momentum, o.dampening, o.wd, o.nesterov, {}};
    std::vector<std::string> state;
    if (o.momentum != 0) state.push_back("momentum_buffer");
    compare(c, ref, state,
            "sgd momentum " + std::to_string(o.momentum) + " dampening " + std::to_string(o.dampening) + " wd " +
                std::to_string(o.wd) + (o.nesterov ? " nesterov" : ""));
  }
}

// Parameters the fused kernels do not take (float64 here) keep the
// single-tensor path, with the same results.
TEST(FusedOptimizer, OtherDtypesTakeTheSingleTensorPath) {
  const OptimizerConfig c = adamw();
  compare(c, adamw_reference(c), {"exp_avg", "exp_avg_sq"}, "adamw float64", torch::kDouble);
}

}  // namespace
}  // namespace composer

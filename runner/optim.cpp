#include "runner/optim.h"

#include <cmath>

namespace composer {

torch::Tensor compute_loss(const LossConfig& loss, const torch::Tensor& output, const torch::Tensor& targets,
                           int64_t n, int64_t global) {
  // Reduced-precision outputs are promoted so the loss itself is float32.
  auto y = output.scalar_type() == torch::kBFloat16 ? output.to(torch::kFloat) : output;
  torch::Tensor l;
  bool mean_type = true;
  switch (loss.name) {
    case LossKind::kSum:
      l = y.sum();
      mean_type = false;
      break;
    case LossKind::kMean: l = y.mean(); break;
    case LossKind::kMse: l = torch::mse_loss(y, targets.to(y.scalar_type())); break;
    case LossKind::kCrossEntropy:
      l = torch::cross_entropy_loss(y.reshape({-1, y.size(-1)}), targets.reshape({-1}));
      break;
    case LossKind::kSoftCrossEntropy:
      l = torch::cross_entropy_loss(y.reshape({-1, y.size(-1)}),
                                    targets.to(y.scalar_type()).reshape({-1, y.size(-1)}));
      break;
  }
  double w = mean_type ? static_cast<double>(n) / static_cast<double>(global) : 1.0;
  return l * (w * loss.scale);
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& c,
                                                        std::vector<torch::Tensor> params) {
  using namespace torch::optim;
  switch (c.name) {
    case OptimizerKind::kSgd:
      return std::make_unique<SGD>(params, SGDOptions(c.lr)
                                               .momentum(c.momentum)
                                               .dampening(c.dampening)
                                               .nesterov(c.nesterov)
                                               .weight_decay(c.weight_decay));
    case OptimizerKind::kAdam:
      return std::make_unique<Adam>(params, AdamOptions(c.lr)
                                                .betas(std::make_tuple(c.betas[0], c.betas[1]))
                                                .eps(c.eps)
                                                .weight_decay(c.weight_decay));
    case OptimizerKind::kAdamW:
      return std::make_unique<AdamW>(params, AdamWOptions(c.lr)
                                                 .betas(std::make_tuple(c.betas[0], c.betas[1]))
                                                 .eps(c.eps)
                                                 .weight_decay(c.weight_decay));
  }
  return nullptr;
}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

double lr_at(const OptimizerConfig& opt, const LrScheduleConfig& s, int64_t step, int64_t steps) {
  const double lr = opt.lr;
  if (step <= s.warmup_steps) return lr * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  if (s.decay == Decay::kNone) return lr;
  const double span = static_cast<double>(std::max<int64_t>(1, steps - s.warmup_steps));
  const double progress = static_cast<double>(step - s.warmup_steps - 1) / span;
  if (s.decay == Decay::kLinear) return lr + (s.min_lr - lr) * progress;
  return s.min_lr + (lr - s.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

double grad_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> norms;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    auto g = p.grad().detach();
    norms.push_back((g.scalar_type() == torch::kDouble ? g : g.to(torch::kFloat)).norm(2));
  }
  if (norms.empty()) return 0.0;
  return torch::stack(norms).norm(2).item<double>();
}

void clip_grads(const std::vector<torch::Tensor>& params, double norm, double max_norm) {
  const double coef = std::min(1.0, max_norm / (norm + 1e-6));
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.mutable_grad().mul_(coef);
  }
}

}  // namespace composer

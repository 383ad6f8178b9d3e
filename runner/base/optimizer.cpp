#include "runner/base/optimizer.h"

namespace composer {

Optimizer::Optimizer(std::vector<torch::Tensor> params, std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor Optimizer::step(LossClosure closure) {
  TORCH_CHECK(!closure, "composer's optimizers take no closure");
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      State& s = states_[p.unsafeGetTensorImpl()];
      s.step += 1;
      update(p, p.grad(), s, group.options());
    }
  }
  ++steps_;
  return {};
}

Optimizer::State* Optimizer::state_of(const torch::Tensor& p) {
  auto it = states_.find(p.unsafeGetTensorImpl());
  return it == states_.end() ? nullptr : &it->second;
}

Optimizer::State& Optimizer::restore_state_of(const torch::Tensor& p, double step) {
  State& s = states_[p.unsafeGetTensorImpl()];
  s.step = step;
  return s;
}

}  // namespace composer

#include "runner/base/optimizer.h"

namespace composer {

Optimizer::Optimizer(std::vector<torch::Tensor> params, std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor Optimizer::step(LossClosure closure) {
  TORCH_CHECK(!closure, "composer's optimizers take no closure");
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    std::vector<Update> updates;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      State& s = states_[p.unsafeGetTensorImpl()];
      s.step += 1;
      updates.push_back({p, p.grad(), &s});
    }
    update_all(updates, group.options());
  }
  ++steps_;
  return {};
}

void Optimizer::update_all(std::vector<Update>& updates, const torch::optim::OptimizerOptions& o) {
  for (auto& u : updates) update(u.param, u.grad, *u.state, o);
}

void Optimizer::set_lr(double lr, double peak) {
  auto& groups = param_groups();
  if (peaks_.empty()) {
    for (auto& g : groups) peaks_.push_back(g.options().get_lr());
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const double own = i < peaks_.size() ? peaks_[i] : peak;
    groups[i].options().set_lr(own == peak || peak <= 0 ? lr : lr * (own / peak));
  }
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

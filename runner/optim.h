// Losses, optimizers and learning-rate schedules, with PyTorch's math.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runner/config.h"

namespace composer {

// The loss of one microbatch of `n` samples out of a global batch of `global`
// samples, weighted so that the microbatch losses add up to the global-batch
// loss: mean-type losses by n/global, sum-type losses by 1; times loss.scale.
torch::Tensor compute_loss(const LossConfig& loss, const torch::Tensor& output, const torch::Tensor& targets,
                           int64_t n, int64_t global);

// composer's optimizers (SGD, Adam, AdamW) compute what torch.optim's
// single-tensor path computes, op for op, and keep each parameter's state
// where checkpoints can save and restore it.
class Optimizer : public torch::optim::Optimizer {
 public:
  struct State {
    double step = 0;                               // this parameter's updates so far
    std::map<std::string, torch::Tensor> tensors;  // e.g. exp_avg, exp_avg_sq: the parameter's shape
  };
  torch::Tensor step(LossClosure closure = nullptr) override;
  // The state tensors a parameter has after its first update, by name.
  virtual std::vector<std::string> state_names() const = 0;
  // p's state; null before its first update.
  State* state_of(const torch::Tensor& p);
  // p's state to fill from a checkpoint, as if `step` updates had run.
  State& restore_state_of(const torch::Tensor& p, double step);
  int64_t steps() const { return steps_; }
  void set_steps(int64_t n) { steps_ = n; }

 protected:
  Optimizer(std::vector<torch::Tensor> params, std::unique_ptr<torch::optim::OptimizerOptions> defaults);

 private:
  virtual void update(torch::Tensor& p, torch::Tensor grad, State& s, const torch::optim::OptimizerOptions& o) = 0;
  std::unordered_map<c10::TensorImpl*, State> states_;
  int64_t steps_ = 0;
};

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& c, std::vector<torch::Tensor> params);

void set_lr(torch::optim::Optimizer& opt, double lr);

// The learning rate of `step` (1-based) out of `steps`: linear warmup over
// warmup_steps (lr * step / warmup_steps), then none/linear/cosine decay from
// lr to min_lr, reaching min_lr one step after the last.
double lr_at(const OptimizerConfig& opt, const LrScheduleConfig& s, int64_t step, int64_t steps);

// The global L2 norm of the gradients (each grad's norm in float32, float64
// for float64 gradients, then the norm of those), as clip_grad_norm_ does.
double grad_norm(const std::vector<torch::Tensor>& params);

// Scales gradients by min(1, max_norm / (norm + 1e-6)).
void clip_grads(const std::vector<torch::Tensor>& params, double norm, double max_norm);

}  // namespace composer

// The optimizer base whose per-parameter state checkpoints save and restore;
// the optimizers themselves (SGD, Adam, AdamW, Muon) are in runner/train/optim.h.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace composer {

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
  // The state tensors the parameter `name` (p) has after its first update, by
  // name; also for parameters this rank does not train (another stage's).
  virtual std::vector<std::string> state_names(const std::string& name, const torch::Tensor& p) const = 0;
  // Every group's lr at `lr` over the peak `peak` (optimizer.lr): a group whose
  // own peak differs (Muon's matrices) keeps its ratio to it.
  void set_lr(double lr, double peak);
  // p's state; null before its first update.
  State* state_of(const torch::Tensor& p);
  // p's state to fill from a checkpoint, as if `step` updates had run.
  State& restore_state_of(const torch::Tensor& p, double step);
  int64_t steps() const { return steps_; }
  void set_steps(int64_t n) { steps_ = n; }

 protected:
  Optimizer(std::vector<torch::Tensor> params, std::unique_ptr<torch::optim::OptimizerOptions> defaults);

  // A parameter with a gradient, in one step (its state's step already counts it).
  struct Update {
    torch::Tensor param;
    torch::Tensor grad;
    State* state;
  };

 private:
  virtual void update(torch::Tensor& p, torch::Tensor grad, State& s, const torch::optim::OptimizerOptions& o) = 0;
  // Every parameter of a group in one step: update() for each, unless an
  // optimizer batches them (multi-tensor kernels on a GPU).
  virtual void update_all(std::vector<Update>& updates, const torch::optim::OptimizerOptions& o);
  std::unordered_map<c10::TensorImpl*, State> states_;
  std::vector<double> peaks_;  // each group's lr when first scheduled
  int64_t steps_ = 0;
};

}  // namespace composer

// Losses, optimizers and learning-rate schedules, with PyTorch's math.
#pragma once
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runner/base/optimizer.h"
#include "parallelisms/tensor_parallel.h"
#include "runner/config/config.h"

namespace composer {

// The loss of one microbatch of `n` samples out of a global batch of `global`
// samples, weighted so that the microbatch losses add up to the global-batch
// loss: mean-type losses by n/global, sum-type losses by 1; times loss.scale.
// With `vocab` (loss parallel), cross entropy takes logits sharded over it.
// With `loss_tokens` > 0 (packed documents without loss_on_boundary), cross
// entropy is the sum over the targets that are not -100 divided by
// loss_tokens, the global batch's count of them.
torch::Tensor compute_loss(const LossConfig& loss, const torch::Tensor& output, const torch::Tensor& targets,
                           int64_t n, int64_t global, const parallel::VocabParallel& vocab = {},
                           double loss_tokens = 0);

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& c, std::vector<torch::Tensor> params);

void set_lr(torch::optim::Optimizer& opt, double lr);

// One Adam (or, `decoupled`, AdamW) step through torch.optim's fused kernel
// (fused=True): one pass over each parameter, reading its gradient and both
// moments and writing the moments and the parameter. Every tensor on one
// device and of one dtype; `steps` are the steps being taken (1-based), one
// per parameter. The optimizers' path for parameters on a GPU; it runs on the
// CPU too (ATen has both kernels), where the tests check its arithmetic.
void adam_step_fused_aten(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                          const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
                          const std::vector<int64_t>& steps, double lr, double beta1, double beta2, double eps,
                          double weight_decay, bool decoupled);

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

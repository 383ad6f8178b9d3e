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
#include "parallelisms/whole_matrix.h"
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

// The optimizer c names over `params`. Muon needs each parameter's FQN
// (`names`, for optimizer.muon.exclude) and where its matrices lie (`whole`;
// null: every parameter is whole on this rank).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& c, std::vector<torch::Tensor> params,
                                          const std::vector<std::string>& names = {},
                                          std::shared_ptr<const parallel::WholeMatrices> whole = nullptr);

// torch.optim.Muon's orthogonalisation (_zeropower_via_newtonschulz) of a
// matrix, in c.ns_dtype (torch's: bfloat16): the same ATen calls in the same
// order; a [n, out, in] stack matrix by matrix.
torch::Tensor newton_schulz(const torch::Tensor& u, const MuonConfig& c);
// The factor Muon's lr takes for a [rows, cols] matrix (adjust_lr_fn).
double muon_lr_ratio(MuonAdjustLr fn, int64_t rows, int64_t cols);
// Each of `params`' FQN in `model` (a tied weight's first name).
std::vector<std::string> names_in(torch::nn::Module& model, const std::vector<torch::Tensor>& params);
// The leading dims of a Muon parameter of this shape that index its matrices:
// 1 for a [experts, out, in] stack, 0 for a matrix.
int muon_stack_dims(const std::vector<int64_t>& shape);
// Whether Muon trains the parameter `name` of this global shape (the rest: AdamW).
bool muon_trains(const MuonConfig& c, const std::string& name, const std::vector<int64_t>& global_shape);

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

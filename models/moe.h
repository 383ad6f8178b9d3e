// The feed-forward layers of the Llama family: the dense SwiGLU (FeedForward)
// and the mixture of experts (MoE) that takes its place when model.args.n_experts
// is set: a router scores every token against n_experts SwiGLU experts, each
// token goes to its top_k, their outputs come back weighted by the router, and
// optional shared experts see every token (torchtitan's and DeepSeek-V3's form).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "models/layers.h"

namespace composer::models {

// w2(silu(w1 x) * w3 x): torchtitan's FeedForward, with its names.
class FeedForward : public nn::Module {
 public:
  FeedForward(int64_t dim, int64_t hidden);
  torch::Tensor forward(torch::Tensor x) override;
  std::shared_ptr<nn::Linear> w1, w2, w3;
};

// Every routed expert's SwiGLU weights, stacked on a leading expert dim:
// w1 and w3 [experts, hidden, dim], w2 [experts, dim, hidden]. Expert
// parallelism keeps a contiguous block of them on each rank (dim 0 sharded).
class GroupedExperts : public nn::Module {
 public:
  // grouped: each projection one grouped product (at::_grouped_mm) over every
  // expert's rows where the kernel holds (grouped_kernel_holds); otherwise, and
  // without it, one product per expert. The two give the same values on the CPU.
  GroupedExperts(int64_t experts, int64_t dim, int64_t hidden, bool grouped = true);
  // Rows of `x` grouped by expert, counts[j] rows for the j-th expert held here,
  // in order; each group goes through its expert.
  torch::Tensor run(const torch::Tensor& x, const std::vector<int64_t>& counts);
  torch::Tensor forward(torch::Tensor x) override;  // every row through expert 0 (never used by MoE)
  // Whether run takes the grouped products for rows `x`: dim and hidden
  // multiples of 16 bytes of x's dtype, and on CUDA bfloat16 (the dtype ATen
  // has the grouped kernel for) from 16-byte aligned rows.
  bool grouped_kernel_holds(const torch::Tensor& x) const;
  torch::Tensor w1, w2, w3;
  bool grouped = true;

 private:
  torch::Tensor run_each(const torch::Tensor& x, const std::vector<int64_t>& counts);
};

struct MoeArgs {
  int64_t experts = 0, top_k = 1, shared = 0, hidden = 0;
  bool sigmoid = false;  // score function: softmax over the experts, or a sigmoid each
  bool route_norm = false;
  double route_scale = 1.0;
  double aux_loss_coeff = 0;    // the load-balancing loss's coefficient (0: none)
  double bias_update_rate = 0;  // the auxiliary-loss-free balancing bias's step (0: no bias)
  double capacity_factor = 0;   // rows each expert takes per sequence, x S x top_k / experts (0: dropless)
  double z_loss_coeff = 0;      // the router z-loss's coefficient (0: none)
  // Group-limited routing (DeepSeek-V3): the experts in n_group contiguous
  // groups; a token picks its top_k among the topk_group groups whose two best
  // scores (plus bias) sum highest. n_group 1: every expert.
  int64_t n_group = 1, topk_group = 1;
  bool expert_bias = false;  // an expert bias even without updates (bias_update_rate 0): a checkpoint's
  bool grouped_mm = true;    // the experts' products grouped (GroupedExperts::grouped)
};

// The routed feed-forward. Per token: scores = softmax or sigmoid of the
// router's logits (float32); its top_k experts by score plus expert_bias
// (ties to the lower index), among the experts of its topk_group best groups
// with n_group; their weights are the scores (without the bias),
// divided by their sum when route_norm (plus 1e-20), times route_scale. The
// token's rows, sorted stably by expert, go through the experts; each output
// times its weight is added back at its token, and the shared experts' output
// on top. Dropless by default; with a capacity factor, each expert takes at
// most ceil(capacity_factor x S x top_k / experts) rows of each sequence, its
// earliest tokens first, and the later rows are dropped (they add nothing).
// In a training forward (grad mode on; an activation-checkpointed block's
// recompute, not its first pass) with aux_loss_coeff, the load-balancing loss
// of each sequence s, experts x sum_i f_i P_i (f_i: the fraction of s's rows
// routed to expert i, P_i: s's mean score of i, sigmoid scores normalised to
// sum to 1), times aux_loss_coeff, joins backward with the gradient aux_weight
// (what one sequence's loss gets); its forward value is not in the loss.
// With z_loss_coeff, ST-MoE's router z-loss likewise: each sequence's mean over
// its tokens of logsumexp(router logits)^2, times z_loss_coeff. Per token, so
// it splits over context-parallel ranks: a rank's slice counts its tokens over
// its slice length, and cp's gradient average makes that the sequence's mean.
class MoE : public nn::Module {
 public:
  MoE(int64_t dim, const MoeArgs& a);
  torch::Tensor forward(torch::Tensor x) override;

  // How the expert-sorted rows reach the experts and come back: unset, this
  // rank's GroupedExperts runs them all (counts per expert, every expert here);
  // expert parallelism sets it to its all-to-all dispatch (same contract: rows
  // sorted by global expert id, counts[e] for each of the n_experts, returns
  // each row's expert output in the same order).
  std::function<torch::Tensor(const torch::Tensor& rows, const std::vector<int64_t>& counts)> dispatch;
  // Rows routed to each expert in the last forward on this rank (before any
  // capacity drop or dispatch).
  std::vector<int64_t> last_counts;
  // Summed over this step's training forwards, until take_step_counts().
  std::vector<int64_t> step_counts;
  int64_t step_dropped = 0;  // rows dropped over capacity, likewise
  // The gradient one sequence's load-balancing loss gets: the trainer's loss
  // weight of a sample (loss.scale x its backward scale / global_batch).
  double aux_weight = 0;
  // Auxiliary-loss-free balancing (DeepSeek-V3; Megatron's update): a float32
  // buffer added to the scores for the choice only (with bias_update_rate or
  // MoeArgs::expert_bias; undefined otherwise); after each optimizer step
  // update_bias(the step's counts summed over every rank that routed tokens)
  // adds bias_update_rate x sign(mean count - count) to each expert's.
  torch::Tensor expert_bias;
  void update_bias(const torch::Tensor& counts);

  const MoeArgs& args() const { return args_; }
  std::shared_ptr<nn::Linear> router;
  std::shared_ptr<GroupedExperts> experts;
  std::shared_ptr<FeedForward> shared;  // null without shared experts

 private:
  // The router's float32 logits and scores, each token's top_k expert ids and their weights.
  struct Routing {
    torch::Tensor logits, scores, ids, weights;
  };
  Routing route(const torch::Tensor& flat) const;
  // `out` with the load-balancing loss and the router z-loss joining backward (a training forward on
  // (batch, seq, dim) input only).
  torch::Tensor with_router_losses(torch::Tensor out, const torch::Tensor& x, const Routing& r) const;

  MoeArgs args_;
};

// The mixture-of-experts blocks under `root`, in module order.
std::vector<MoE*> moe_blocks(nn::Module& root);

}  // namespace composer::models

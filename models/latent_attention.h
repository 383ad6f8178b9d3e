// DeepSeek-V3's multi-head latent attention (MLA), with torchtitan's names.
// Per token: the query from x directly (wq) or through a low-rank latent
// (wq_b(q_norm(wq_a x))); one projection wkv_a gives the key/value latent
// (kv_lora_rank wide, normalised by kv_norm) and a rotary key of
// qk_rope_head_dim shared by every head; wkv_b expands the latent into each
// head's key (qk_nope_head_dim) and value (v_head_dim). Each head attends with
// the query [q_nope | rotated q_rope] against the key [k_nope | the rotated
// shared key], softmax-scaled by (qk_nope + qk_rope)^-0.5 times
// rope_softmax_scale (models/rope.h); wo maps the heads' values back. The
// latents' RMSNorms have epsilon 1e-6 whatever the model's norm_eps, as in
// DeepSeek's code and transformers'.
#pragma once
#include <memory>

#include "models/layers.h"
#include "models/sequence.h"

namespace composer::models {

struct LatentAttentionArgs {
  int64_t dim = 0, n_heads = 0;
  int64_t q_lora_rank = 0;  // 0: the query straight from x (wq)
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  double softmax_scale = 1;  // the factor on (qk_nope + qk_rope)^-0.5
};

// The rotary key every head shares: forward is the identity. It marks the
// tensor a split over heads (tensor_parallel's plan) gives a gradient that is
// each rank's heads' part only, so the plan sums it over the ranks there.
class SharedKey : public nn::Module {
 public:
  SharedKey() : Module("SharedKey") {}
  torch::Tensor forward(torch::Tensor x) override { return x; }
};

class LatentAttention : public nn::Module {
 public:
  LatentAttention(const LatentAttentionArgs& a, std::shared_ptr<nn::SequenceSlot> slot);
  // The rotary tables of qk_rope_head_dim (models/rope.h's rope_tables).
  void set_rope(torch::Tensor cos, torch::Tensor sin);
  torch::Tensor forward(torch::Tensor x) override;

  std::shared_ptr<nn::Linear> wq, wq_a, wq_b;  // wq without a query latent; wq_a, wq_b with one
  std::shared_ptr<nn::RMSNorm> q_norm;         // with a query latent
  std::shared_ptr<nn::Linear> wkv_a, wkv_b, wo;
  std::shared_ptr<nn::RMSNorm> kv_norm;
  std::shared_ptr<SharedKey> k_rope;

 private:
  LatentAttentionArgs a_;
  std::shared_ptr<nn::SequenceSlot> slot_;
  torch::Tensor cos_, sin_;
};

}  // namespace composer::models

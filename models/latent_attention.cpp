#include "models/latent_attention.h"

#include "models/rope.h"

namespace composer::models {

using nn::Linear;

namespace {
constexpr double kLatentNormEps = 1e-6;
}  // namespace

LatentAttention::LatentAttention(const LatentAttentionArgs& a, std::shared_ptr<nn::SequenceSlot> slot)
    : Module("Attention"), a_(a), slot_(std::move(slot)) {
  const int64_t qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
  if (a.q_lora_rank == 0) {
    wq = add("wq", std::make_shared<Linear>(a.dim, a.n_heads * qk, false));
  } else {
    wq_a = add("wq_a", std::make_shared<Linear>(a.dim, a.q_lora_rank, false));
    q_norm = add("q_norm", std::make_shared<nn::RMSNorm>(a.q_lora_rank, kLatentNormEps));
    wq_b = add("wq_b", std::make_shared<Linear>(a.q_lora_rank, a.n_heads * qk, false));
  }
  wkv_a = add("wkv_a", std::make_shared<Linear>(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, false));
  kv_norm = add("kv_norm", std::make_shared<nn::RMSNorm>(a.kv_lora_rank, kLatentNormEps));
  wkv_b = add("wkv_b", std::make_shared<Linear>(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), false));
  wo = add("wo", std::make_shared<Linear>(a.n_heads * a.v_head_dim, a.dim, false));
  k_rope = add("k_rope", std::make_shared<SharedKey>());
}

void LatentAttention::set_rope(torch::Tensor cos, torch::Tensor sin) {
  cos_ = std::move(cos);
  sin_ = std::move(sin);
}

torch::Tensor LatentAttention::forward(torch::Tensor x) {
  const int64_t b = x.size(0), s = x.size(1), nope = a_.qk_nope_head_dim, rope = a_.qk_rope_head_dim;
  // Heads as this rank holds them: all, or its share under tensor_parallel.
  auto q = (wq ? (*wq)(x) : (*wq_b)((*q_norm)((*wq_a)(x)))).view({b, s, -1, nope + rope});
  auto kv = (*wkv_a)(x);
  auto latent = (*kv_norm)(kv.narrow(-1, 0, a_.kv_lora_rank));
  auto k_rot = (*k_rope)(kv.narrow(-1, a_.kv_lora_rank, rope)).view({b, s, 1, rope});
  auto [cos, sin] = rope_rows(*slot_, cos_, sin_, b, s, x.device());
  auto q_rot = apply_rope(q.narrow(-1, nope, rope), cos, sin);
  k_rot = apply_rope(k_rot, cos, sin);
  auto kv_heads = (*wkv_b)(latent).view({b, s, -1, nope + a_.v_head_dim});
  const int64_t heads = kv_heads.size(2);
  auto k = torch::cat({kv_heads.narrow(-1, 0, nope), k_rot.expand({b, s, heads, rope})}, -1);
  auto v = kv_heads.narrow(-1, nope, a_.v_head_dim);
  q = torch::cat({q.narrow(-1, 0, nope), q_rot}, -1);
  if (a_.softmax_scale != 1.0) q = q * a_.softmax_scale;  // the attention then scales by (nope + rope)^-0.5
  const torch::Tensor& docs = slot_->doc_start();
  torch::Tensor out;
  if (slot_->split) {
    out = slot_->split->attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), true, docs);
  } else {
    out = nn::attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), true, 0, false,
                        docs.defined() ? slot_->document_mask(true) : torch::Tensor());
  }
  return (*wo)(out.transpose(1, 2).contiguous().view({b, s, -1}));
}

}  // namespace composer::models

// A sequence split over ranks (context parallelism). A model whose attention
// can be split holds a SequenceSlot that its position code and attention read:
// empty, the model computes on the whole sequence it is given; set (by the
// context_parallel transform), the tokens it is given are this rank's slice of
// a longer sequence, their positions come from the split, and attention sees
// the whole sequence's keys and values through it.
#pragma once
#include <torch/torch.h>

#include <memory>

namespace composer::nn {

class SequenceSplit {
 public:
  virtual ~SequenceSplit() = default;
  // The global positions (int64, (local_len,)) of this rank's `local_len` tokens.
  virtual torch::Tensor positions(int64_t local_len, const c10::Device& device) const = 0;
  // softmax(q k^T / sqrt(head_dim) [+ causal mask by global position]) v over
  // the whole sequence, for this rank's queries. q: (batch, heads, local_len,
  // head_dim); k, v: (batch, kv_heads, local_len, head_dim) with kv_heads
  // dividing heads (grouped-query attention: query head h reads kv head
  // h / (heads / kv_heads)).
  virtual torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  bool causal) const = 0;
};

// Shared by a model and its attention modules; the transform sets `split`.
struct SequenceSlot {
  std::shared_ptr<const SequenceSplit> split;
};

// The positions of `local_len` tokens: the split's, or 0 .. local_len-1.
inline torch::Tensor positions(const SequenceSlot* slot, int64_t local_len, const c10::Device& device) {
  if (slot && slot->split) return slot->split->positions(local_len, device);
  return torch::arange(local_len, torch::dtype(torch::kLong).device(device));
}

}  // namespace composer::nn

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
  // head_dim); k: (batch, kv_heads, local_len, head_dim) and v the same but
  // v_dim <= head_dim wide, with kv_heads
  // dividing heads (grouped-query attention: query head h reads kv head
  // h / (heads / kv_heads)).
  // With `doc_start` defined (packed documents, see SequenceSlot), a query sees
  // only the keys of its own document.
  virtual torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  bool causal, const torch::Tensor& doc_start) const = 0;
};

// Shared by a model and its attention modules; the transform sets `split`,
// the training loop `doc_start` before each microbatch's forward and backward.
class SequenceSlot {
 public:
  std::shared_ptr<const SequenceSplit> split;

  // Packed documents: (batch, seq) int64 over the whole sequence (every global
  // position, also under a split), the position where each token's document
  // begins. A token attends only to tokens of its own document and its
  // position restarts at its document's start. Undefined: one document per
  // sequence, as without packing.
  const torch::Tensor& doc_start() const { return doc_start_; }
  void set_doc_start(torch::Tensor doc_start) {
    doc_start_ = std::move(doc_start);
    mask_ = torch::Tensor();
  }
  // The (batch, 1, seq, seq) boolean mask of a whole sequence's attention
  // (true: attend): the same document and, with `causal`, not in the future.
  // Built once per microbatch and shared by every layer (their saved tensors
  // hold one copy).
  const torch::Tensor& document_mask(bool causal);

 private:
  torch::Tensor doc_start_, mask_;
  bool mask_causal_ = false;
};

// Whether query positions `q` meet key positions `k` (1-D int64 global
// positions) in `doc_start`'s documents: (batch, 1, |q|, |k|) booleans, with
// `causal` also no key after its query.
inline torch::Tensor document_mask(const torch::Tensor& doc_start, const torch::Tensor& q, const torch::Tensor& k,
                                   bool causal) {
  auto same = doc_start.index_select(1, q).unsqueeze(2) == doc_start.index_select(1, k).unsqueeze(1);
  if (causal) same = same.bitwise_and(k.unsqueeze(0) <= q.unsqueeze(1));  // logical_and has no meta kernel
  return same.unsqueeze(1);
}

// The mask of whole sequences: every position against every position.
inline torch::Tensor whole_document_mask(const torch::Tensor& doc_start, bool causal) {
  auto all = torch::arange(doc_start.size(1), doc_start.options());
  return document_mask(doc_start, all, all, causal);
}

inline const torch::Tensor& SequenceSlot::document_mask(bool causal) {
  if (!mask_.defined() || mask_causal_ != causal) {
    mask_ = whole_document_mask(doc_start_, causal);
    mask_causal_ = causal;
  }
  return mask_;
}

// The positions of `local_len` tokens: the split's, or 0 .. local_len-1;
// with packed documents each position counted from its document's start,
// (batch, local_len).
inline torch::Tensor positions(const SequenceSlot* slot, int64_t local_len, const c10::Device& device) {
  auto global = slot && slot->split ? slot->split->positions(local_len, device)
                                    : torch::arange(local_len, torch::dtype(torch::kLong).device(device));
  if (!slot || !slot->doc_start().defined()) return global;
  const torch::Tensor& docs = slot->doc_start();
  auto at = global.to(docs.device());
  return (at.unsqueeze(0) - docs.index_select(1, at)).to(device);
}

}  // namespace composer::nn

#include "models/saved_ops.h"

namespace composer::nn {
namespace {

thread_local SavedOps* active_ops = nullptr;

}  // namespace

SavedOps::Scope::Scope(SavedOps* ops, bool replay) : previous_(active_ops) {
  if (!ops) return;
  ops->replay_ = replay;
  ops->next_ = 0;
  active_ops = ops;
}

SavedOps::Scope::~Scope() { active_ops = previous_; }

SavedOps* SavedOps::active() { return active_ops; }

bool SavedOps::keep_next() {
  const bool keep = (static_cast<int64_t>(next_) + 1) % every_ == 0;
  ++next_;
  kept_.emplace_back();
  return keep;
}

void SavedOps::keep(std::vector<torch::Tensor> outputs) {
  TORCH_INTERNAL_ASSERT(!kept_.empty());
  kept_.back() = std::move(outputs);
}

std::vector<torch::Tensor> SavedOps::take_next() {
  TORCH_CHECK(next_ < kept_.size(), "activation checkpointing (op): the recompute reached more kept-kind ops (",
              next_ + 1, ") than the forward did (", kept_.size(), ")");
  auto outputs = std::move(kept_[next_++]);
  if (!outputs.empty()) ++taken_;
  return outputs;
}

}  // namespace composer::nn

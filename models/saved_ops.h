// Selective activation checkpointing by operation (activation_checkpointing
// with mode: op, torchtitan's "op" policy): a checkpointed unit's forward
// keeps the outputs of its matrix products (Linear layers) and attention, and
// its backward recomputes only the rest (norms, activations, rotary, residual
// additions) around them.
//
// The checkpoint opens a SavedOps scope twice on the unit's thread: while its
// forward runs without a graph (recording), each op that may be kept asks the
// scope whether to keep its output; while its backward recomputes the forward
// (replaying), the same op, reached in the same order, takes the kept output
// back and returns it through an autograd function with the op's own backward
// (the matmuls autograd's mm backward does; the CPU flash attention's backward
// kernel), so nothing it kept is computed twice.
//
// What may be kept: a Linear computed by torch::linear (not a layer with a
// fused tensor-parallel collective or float8), and attention where LibTorch
// runs its CPU flash kernel (no dropout; on a dry run's meta tensors the same
// shapes). Attention on a GPU and the context-parallel ring's attention are
// recomputed.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace composer::nn {

class SavedOps {
 public:
  enum Kind : unsigned { kLinear = 1, kAttention = 2 };
  // Keeps the outputs of the ops of the `kinds` (a mask of Kind), every
  // `every`-th of them in forward order (the every-th, 2 x every-th, ...).
  SavedOps(unsigned kinds, int64_t every) : kinds_(kinds), every_(every) {}

  // Opens `ops` on this thread for the scope's life: recording, or replaying
  // what was recorded (from its first op). nullptr opens nothing.
  class Scope {
   public:
    Scope(SavedOps* ops, bool replay);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SavedOps* previous_;
  };
  static SavedOps* active();

  bool wants(Kind kind) const { return (kinds_ & kind) != 0; }
  bool replaying() const { return replay_; }
  // The next op of a kept kind, recording: whether to keep its outputs.
  bool keep_next();
  void keep(std::vector<torch::Tensor> outputs);
  // The next op of a kept kind, replaying: its kept outputs (empty: recompute it).
  std::vector<torch::Tensor> take_next();
  // Drops everything kept (after the replay).
  void clear() { kept_.clear(); }
  // How many ops the replays so far took their kept outputs back for.
  int64_t taken() const { return taken_; }

 private:
  unsigned kinds_;
  int64_t every_;
  bool replay_ = false;
  size_t next_ = 0;                               // the op's index in forward order
  int64_t taken_ = 0;
  std::vector<std::vector<torch::Tensor>> kept_;  // per op: its outputs, or none
};

}  // namespace composer::nn

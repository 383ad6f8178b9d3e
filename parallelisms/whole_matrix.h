// Whole matrices for optimizers that need them (Muon's Newton-Schulz
// orthogonalisation): each matrix is gathered onto one owner among the ranks
// that hold its pieces, a function runs there on the whole matrix, and every
// holder gets its piece of the result back. Read from the placements only, so
// it holds under any composition of fully_shard, HSDP, tensor_parallel,
// expert_parallel, context_parallel and pipeline stages.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "parallelisms/placement.h"

namespace composer::parallel {

// Why owner-computes: gathering every matrix onto every holder (all-gather)
// moves (n - 1) x each matrix over n holders and repeats the iterations n
// times; a gather to one owner and a scatter back move 2 (n - 1) / n x it in
// all, and owners chosen by cost (largest first, to the least loaded holder)
// spread the iterations over the holders. Replicas (replicate, cp, tp copies)
// compute the same owners' results, each in its own group.
class WholeMatrices {
 public:
  // Null placements: every tensor is whole on this rank.
  explicit WholeMatrices(const Placements* placements);
  ~WholeMatrices();

  // For each params[i] (a matrix, or with batch_dims[i] = 1 a stack of them:
  // [experts, out, in], whose shards on the stack's dim need no gathering),
  // fn(whole locals[i]) computed on its owner, and this rank's piece of it.
  // fn returns a tensor of the whole's shape; its pieces travel back as
  // `result_dtype`. Every holder calls this with the same params in the
  // same order (the gathers and scatters are point to point, in that order).
  std::vector<torch::Tensor> apply(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& locals,
                                   const std::vector<int>& batch_dims, c10::ScalarType result_dtype,
                                   const std::function<torch::Tensor(const torch::Tensor&)>& fn) const;

  // p's global shape (its own shape when it has no placement).
  std::vector<int64_t> global_shape(const torch::Tensor& p) const;

  // The dims of `spec` (indices into spec.dims) whose ranks hold pieces of a
  // matrix that must be joined: a Shard over more than one rank of a dim past
  // the first `batch_dims` (a stack's expert dim leaves each matrix whole).
  static std::vector<size_t> splitting_dims(const ShardSpec& spec, int batch_dims);

  // One matrix's levels (the splitting dims) and their owners.
  struct Route;

 private:
  // Each matrix's route depends only on the parameters and their placements:
  // made on the first apply() for a list of them, kept for the next steps.
  const std::vector<Route>& routes(const std::vector<torch::Tensor>& params, const std::vector<int>& batch_dims) const;
  const Placements* placements_;
  mutable std::vector<const c10::TensorImpl*> routed_;  // the list routes_ was made for
  mutable std::vector<Route> routes_;
};

}  // namespace composer::parallel

// Placements: where every parameter (and so its gradient and optimizer state)
// lives over the mesh. Each transform records what it does to a parameter
// here and nothing else; gathering full tensors, the gradient norm, the
// golden comparison, the final weights and the gradient synchronisation
// (grad_sync.h) all read only these specs.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "parallelisms/comm/collectives.h"

namespace composer::parallel {

// How a tensor lives on one mesh dim: Shard(d) splits tensor dim d into
// torch.chunk pieces, Replicate keeps a copy on every rank, Partial holds
// values that still have to be combined (summed or averaged) over the dim.
struct Placement {
  enum class Kind { kReplicate, kShard, kPartial };
  Kind kind = Kind::kReplicate;
  int64_t dim = 0;               // kShard: the tensor dim
  Reduce reduce = Reduce::kSum;  // kPartial: how the rank values combine

  static Placement replicate() { return {}; }
  static Placement shard(int64_t d) { return {Kind::kShard, d, Reduce::kSum}; }
  static Placement partial(Reduce r = Reduce::kSum) { return {Kind::kPartial, 0, r}; }
  bool is_shard() const { return kind == Kind::kShard; }
  bool is_partial() const { return kind == Kind::kPartial; }
  bool operator==(const Placement& o) const { return kind == o.kind && dim == o.dim && reduce == o.reduce; }
  std::string str() const;  // "R", "S(0)", "P(sum)", "P(avg)"
};

// One mesh dim (or several flattened) that a tensor is spread over.
struct SpecDim {
  std::string name;            // "tp", "dp", "a+b"
  Group* group = nullptr;      // this rank's group over the dim (nullptr when planning)
  int size = 1;                // ranks on the dim
  int rank = 0;                // this rank's index on it
  Placement param;             // how the parameter (and its optimizer state) lives there
  Placement grad;              // how its gradient comes out of backward, before synchronisation
  // The group ranks that hold the tensor at all (a pipeline's stages); empty
  // means every rank. The others hold nothing; gradients combine over members.
  std::vector<int> members;
  Group* member_group = nullptr;  // the group over `members` (when more than one)
  bool holds() const;
};

// A box in the global tensor: per tensor dim, where this piece starts and its size.
struct Box {
  std::vector<int64_t> offset, size;
};

// The placement of one tensor: its global shape and, in the order the
// transforms applied them, the mesh dims it is spread over. A Shard on a later
// dim splits the piece the earlier dims left (FSDP over tensor-parallel
// shards), so every rank's piece is one box of the global tensor.
struct ShardSpec {
  std::vector<int64_t> global_shape;  // a 0-dim tensor is treated as [1]
  c10::ScalarType dtype = c10::kFloat;
  std::vector<SpecDim> dims;

  // The box of the rank whose index on each of `dims` is `ranks[i]`, after the
  // first `levels` dims (all by default).
  Box box_at(const std::vector<int>& ranks, size_t levels = SIZE_MAX) const;
  Box box(size_t levels = SIZE_MAX) const;  // this rank's
  std::vector<int64_t> local_shape() const { return box().size; }
  // Whether this rank holds the tensor (pipeline members), and whether it is
  // the one copy that counts in a global sum (index 0 of every dim it is
  // replicated on, the first member of a pipeline dim).
  bool held() const;
  bool counts() const;
  // Whether an earlier transform split the tensor over one of `names` (expert_parallel's experts over the
  // dim a data-parallel transform then spans).
  bool split_over(const std::vector<std::string>& names) const;
  SpecDim* find(const std::string& name);
  // "[16, 8] tp:S(0) dp:S(0)/P(avg) pp:R{0,1}"
  std::string str() const;
};

// Every parameter's spec on this rank, keyed by the parameter's TensorImpl
// (stable across set_data). Transforms add their dims in application order.
class Placements {
 public:
  // The spec of `p`, created with its current shape as the global shape.
  ShardSpec& of(const torch::Tensor& p);
  const ShardSpec* find(const torch::Tensor& p) const;
  // Appends a dim to p's spec.
  void add(const torch::Tensor& p, SpecDim d) { of(p).dims.push_back(std::move(d)); }
  // Removes the dim named `name` from every spec (a later transform that
  // spans it records the tensors' placement there instead).
  void drop(const std::string& name);
  // The same, but for the specs `keep` holds to.
  void drop_unless(const std::string& name, const std::function<bool(const ShardSpec&)>& keep);
  size_t size() const { return specs_.size(); }

 private:
  std::unordered_map<const c10::TensorImpl*, ShardSpec> specs_;
};

// The full tensor from this rank's `local` piece (a collective over every
// group the spec names: every rank of the mesh calls it for the same tensors
// in the same order). Ranks that do not hold it join only the broadcast from
// the first member; `pp` is that broadcast's group when a dim has members.
torch::Tensor gather_full(const ShardSpec& spec, const torch::Tensor& local);

// This rank's piece of a full tensor under `spec` (a local slice, no collective).
torch::Tensor local_piece(const ShardSpec& spec, const torch::Tensor& full);

}  // namespace composer::parallel

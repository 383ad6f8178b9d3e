// context_parallel: every rank of the cp dim holds a slice of every sequence.
// Token ids, targets and positions are sliced the same way (slice()), and
// attention sees the whole sequence by moving keys and values between the
// ranks (positions() and attention() serve the model's SequenceSlot):
//   rotate ring: each rank computes its queries against the key/value block it
//     holds, passes the block on around the cp group (send/recv, the next
//     block's transfer overlapping this block's compute) and merges the
//     partial results by their log-sum-exp; backward passes the blocks around
//     again with their key/value gradients, which arrive home after a full
//     turn. No rank holds more than two blocks of keys and values.
//   rotate allgather: every rank gathers every block (simpler, cp x the
//     key/value memory); backward reduce-scatters their gradients.
// With load_balance, rank i of n holds chunks i and 2n-1-i of 2n equal chunks
// (the "head-tail" layout), so under a causal mask every rank computes the
// same amount of attention; causal masks are exact for any layout. Attention
// runs over tiles of at most 256 queries and 256 keys merged by log-sum-exp
// (tiles wholly in a query's future skipped), so no rank holds more than a
// tile pair's scores per head at once, as a flash-attention kernel would not.
// Packed documents (a doc_start, models/sequence.h) mask every tile pair to
// the keys of each query's document, and a pair that shares no document in
// any sequence of the batch is skipped as a future one is; alltoall's whole
// sequences take the one-device mask.
// Parameters are replicated over cp and their gradients averaged there: each
// rank's loss is the mean over its tokens, the same number on every rank.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/config_fields.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

enum class Rotate { kRing, kAllGather, kAllToAll };
inline constexpr EnumName<Rotate> kRotateNames[] = {
    {Rotate::kRing, "ring"}, {Rotate::kAllGather, "allgather"}, {Rotate::kAllToAll, "alltoall"}};
inline const auto& names_of(Rotate) { return kRotateNames; }
const char* name_of(Rotate r);

class ContextParallel;

// The `context_parallel` transform's options (docs/configuration.md).
struct ContextParallelConfig {
  static constexpr const char* kKey = "context_parallel";
  static constexpr Splits kSplits = Splits::kSequence;
  static constexpr bool kMovesActivations = true;  // keys and values pass between the cp ranks
  using Runtime = ContextParallel;
  std::vector<std::string> mesh_dim{"cp"};
  bool load_balance = true;
  Rotate rotate = Rotate::kRing;

  template <class V>
  void fields(V& v) {
    v("mesh_dim", mesh_dim, kOneOrList);  // the one mesh dim whose ranks split each sequence
    v("load_balance", load_balance);      // rank i holds chunks i and 2cp-1-i of 2cp (else slice i of cp)
    v("rotate", rotate);                  // how attention sees the whole sequence: ring, allgather or alltoall
  }
};

struct Applying;
struct Tracing;
// Splits every sequence over the cp ranks; the model's attention then moves
// keys and values between them.
bool apply(Applying& a, const ContextParallelConfig& config);
// A stage's input is this rank's slice of the sequence.
void trace(Tracing& t, const ContextParallelConfig& config);

// The sequence chunks rank `rank` of `size` holds, in order: {rank, 2 size-1-rank}
// of 2 size chunks with load balance, else {rank} of size chunks.
std::vector<int64_t> sequence_chunks(int size, int rank, bool load_balance);
// How many equal chunks a sequence is cut into (what its length must divide by).
int64_t chunks_per_sequence(int size, bool load_balance);

class ContextParallel : public nn::SequenceSplit {
 public:
  ContextParallel(Group& group, const ContextParallelConfig& options);
  torch::Tensor positions(int64_t local_len, const c10::Device& device) const override;
  // The global positions of rank `rank`'s `local_len` tokens.
  torch::Tensor positions_of(int rank, int64_t local_len, const c10::Device& device) const;
  torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          bool causal, const torch::Tensor& doc_start) const override;
  // This rank's slice of `t`, whose dim `dim` is a whole sequence.
  torch::Tensor slice(const torch::Tensor& t, int64_t dim) const;
  Group& group() const { return group_; }
  const ContextParallelConfig& options() const { return options_; }

 private:
  Group& group_;
  ContextParallelConfig options_;
};

// Installs the split in `model`'s sequence slot and records every parameter
// the roots hold as Replicate over the group with its gradient Partial (avg).
// The model must have a slot (models::ModelSpec::cp_check says which do).
std::shared_ptr<ContextParallel> apply_context_parallel(models::Model& model, const std::vector<models::Root>& roots,
                                                        Group& group, const ContextParallelConfig& options,
                                                        Placements& placements);

}  // namespace composer::parallel

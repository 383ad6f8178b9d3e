// Tensor-parallel plans as data: module FQN patterns mapped to styles with
// their activation layouts. Each model declares its named plans next to the
// model; parallelisms/tensor_parallel.cpp gives them their meaning.
#pragma once
#include <string>
#include <vector>

namespace composer::models {

// An activation's layout over the tp ranks: replicated, or sharded on `dim`
// (negative counts from the end, as in PyTorch).
struct Layout {
  bool sharded = false;
  int dim = 0;
  static Layout replicate() { return {false, 0}; }
  static Layout shard(int d) { return {true, d}; }
  bool operator==(const Layout& o) const { return sharded == o.sharded && (!sharded || dim == o.dim); }
};

enum class TpStyle {
  kColwise,           // Linear: weight/bias sharded on the output dim
  kRowwise,           // Linear: weight sharded on the input dim; Embedding: vocab-parallel rows
  kSequenceParallel,  // LayerNorm/RMSNorm on sequence-sharded activations
  kPrepareInput,      // redistribute a module's input from `input` to `desired_input`
  kSharedInput,       // a replicated input every rank's heads use: its gradient, each rank's part, summed over tp
};

struct TpRule {
  std::string pattern;  // FQN glob; '*' matches within one dotted segment
  TpStyle style = TpStyle::kColwise;
  Layout input = Layout::replicate();          // the layout the module's input arrives in
  Layout output = Layout::shard(-1);           // colwise default: local shard of the last dim
  Layout desired_input = Layout::replicate();  // prepare_input only
};

using TpPlan = std::vector<TpRule>;

}  // namespace composer::models

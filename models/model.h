// What every registered model provides: typed arguments with defaults, an
// input description for the data pipeline, and a builder.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "models/module.h"
#include "models/sequence.h"
#include "models/tp_plan.h"

namespace composer::models {

enum class ArgType { kInt, kFloat, kBool, kString };

using ArgValue = std::variant<int64_t, double, bool, std::string>;

// One model argument: its YAML name, type, default and a one-line description.
struct ArgSpec {
  std::string name;
  ArgType type;
  ArgValue default_value;
  std::string doc;
  // Left out of the resolved config (and so of its hash) while at its
  // default: an argument added to a model after goldens of it were written,
  // whose configs keep their hash while they do not use it.
  bool quiet_default = false;
};

// Resolved model arguments (every ArgSpec present, defaults filled in).
class ModelArgs {
 public:
  void set(const std::string& name, ArgValue v) { values_[name] = std::move(v); }
  int64_t i(const std::string& name) const { return std::get<int64_t>(at(name)); }
  double f(const std::string& name) const { return std::get<double>(at(name)); }
  bool b(const std::string& name) const { return std::get<bool>(at(name)); }
  const std::string& s(const std::string& name) const { return std::get<std::string>(at(name)); }
  const std::map<std::string, ArgValue>& values() const { return values_; }
  // The arguments (ArgSpec::quiet_default) the resolved config leaves out at `def`.
  void quiet_at(const std::string& name, ArgValue def) { quiet_[name] = std::move(def); }
  bool quiet(const std::string& name) const {
    auto it = quiet_.find(name);
    return it != quiet_.end() && values_.count(name) && values_.at(name) == it->second;
  }

 private:
  const ArgValue& at(const std::string& name) const;
  std::map<std::string, ArgValue> values_;
  std::map<std::string, ArgValue> quiet_;
};

// An invalid argument value; the config reader adds the YAML position.
class ArgError : public std::runtime_error {
 public:
  ArgError(std::string arg, const std::string& message)
      : std::runtime_error(message), arg_(std::move(arg)) {}
  const std::string& arg() const { return arg_; }

 private:
  std::string arg_;
};

// What a model consumes: token ids (batch, seq) or features (batch, features).
struct InputSpec {
  bool tokens = false;
  int64_t features = 0;     // per-sample feature count for float inputs
  int64_t vocab_size = 0;   // for token inputs
  int64_t max_seq_len = 0;  // for token inputs
};

// One piece of a model's forward that a pipeline stage can hold: the pieces,
// run in order, compute the model's forward. `name` is the FQN a split point
// names (e.g. "layers.2"); `modules` are the FQNs of the modules whose
// parameters the piece computes with; `layer` marks the repeated middle
// pieces that layers_per_stage counts.
struct PipelinePiece {
  std::string name;
  std::vector<std::string> modules;
  bool layer = true;
  std::function<torch::Tensor(torch::Tensor)> run;
};

// One layer piece per child of `list`, named "<prefix>.<i>".
inline std::vector<PipelinePiece> layer_pieces(const std::string& prefix, const nn::ModuleList& list) {
  std::vector<PipelinePiece> out;
  for (size_t i = 0; i < list.size(); ++i) {
    nn::ModulePtr layer = list.at(i);
    const std::string name = prefix + "." + std::to_string(i);
    out.push_back({name, {name}, true, [layer](torch::Tensor x) { return (*layer)(x); }});
  }
  return out;
}

class Model : public nn::Module {
 public:
  using nn::Module::Module;
  virtual InputSpec input_spec() const = 0;
  // The model as pipeline pieces; empty when it cannot be split into stages.
  std::vector<PipelinePiece> pipeline_pieces() { return pieces_ ? pieces_(*this) : std::vector<PipelinePiece>{}; }
  // Where context parallelism installs a sequence split (sequence.h); null
  // for a model whose attention cannot be split over the sequence.
  nn::SequenceSlot* sequence_slot() { return slot_ ? slot_(*this) : nullptr; }

  using PiecesFn = std::function<std::vector<PipelinePiece>(Model&)>;
  using SlotFn = std::function<nn::SequenceSlot*(Model&)>;
  // Set once by the builder of the model's spec (ModelDecl, model_decl.h), so
  // that what a model can do is what its declaration says.
  void bind_declared(PiecesFn pieces, SlotFn slot) {
    pieces_ = std::move(pieces);
    slot_ = std::move(slot);
  }

 private:
  PiecesFn pieces_;
  SlotFn slot_;
};

using ModelPtr = std::shared_ptr<Model>;

// What the planner asks of a model before building it.
enum class Capability {
  kPipeline,         // cuts into pipeline pieces
  kTpPlan,           // has a built-in tensor-parallel plan
  kContextParallel,  // has attention context parallelism can split over the sequence
  kLogits,           // has vocabulary logits for loss parallel
  kExperts,          // may have routed experts (expert parallelism)
  kHuggingFace,      // reads and writes Hugging Face folders (an HfAdapter)
};

class HfAdapter;  // models/hf_adapter.h

// A registry entry: the name used in YAML (model.name), its arguments, a
// validity check (throws ArgError) and the builder. Each model writes its
// entry in one declaration beside the model (ModelDecl, model_decl.h).
struct ModelSpec {
  std::string name;
  std::string doc;
  std::vector<ArgSpec> args;
  std::function<void(const ModelArgs&)> check;
  std::function<ModelPtr(const ModelArgs&)> build;
  // The model's tensor-parallel plan (TpPlan) for `sequence_parallel`, and any
  // divisibility the plan needs at `tp` ranks (throws ArgError). Unset: the
  // model has no built-in plan.
  std::function<TpPlan(const ModelArgs&, bool sequence_parallel)> tp_plan;
  std::function<void(const ModelArgs&, int64_t tp, bool sequence_parallel)> tp_check;
  // What context parallelism needs of the arguments (throws ArgError). Unset:
  // the model has no attention context parallelism can split.
  std::function<void(const ModelArgs&)> cp_check;
  // The Linear whose outputs are the vocabulary's logits (loss parallel keeps
  // them sharded over tp); empty: the model has none.
  std::string logits;
  // How many routed experts each mixture-of-experts block has under the
  // arguments (0: none, a dense model). Unset: the model never has any.
  std::function<int64_t(const ModelArgs&)> experts;
  // How a built model cuts into pipeline pieces and where its sequence slot
  // is; `build` binds both to every model it returns. Unset: it cannot.
  Model::PiecesFn pipeline;
  Model::SlotFn sequence_slot;
  // The family's Hugging Face adapter (models/hf_adapter.h); null: the model
  // has no Hugging Face layout.
  std::shared_ptr<const HfAdapter> hf;

  // Whether the declaration gives the model `c`.
  bool has(Capability c) const;
};

// Rule constructors for plans.
TpRule colwise(std::string pattern, Layout input = Layout::replicate(), Layout output = Layout::shard(-1));
TpRule rowwise(std::string pattern, Layout input = Layout::shard(-1), Layout output = Layout::replicate());
TpRule sequence_parallel(std::string pattern);
TpRule prepare_input(std::string pattern, Layout input, Layout desired);
TpRule shared_input(std::string pattern);

// Helpers for checks.
void require_arg_positive(const ModelArgs& a, const std::string& name);
void require_arg_divides(const ModelArgs& a, const std::string& divisor, const std::string& dividend);

}  // namespace composer::models

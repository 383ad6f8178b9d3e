// A model's one declaration, written beside the model class M in its file:
// ModelDecl<M>(name, doc).args(...).check(...).build(...).tp_plan(...)... converts to
// the ModelSpec the registry holds, so the registry answers for M without building it.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "models/model.h"

namespace composer::models {

// Argument constructors: YAML name, default, one-line description.
inline ArgSpec int_arg(std::string name, int64_t def, std::string doc) {
  return {std::move(name), ArgType::kInt, def, std::move(doc)};
}
inline ArgSpec float_arg(std::string name, double def, std::string doc) {
  return {std::move(name), ArgType::kFloat, def, std::move(doc)};
}
inline ArgSpec bool_arg(std::string name, bool def, std::string doc) {
  return {std::move(name), ArgType::kBool, def, std::move(doc)};
}
inline ArgSpec string_arg(std::string name, std::string def, std::string doc) {
  return {std::move(name), ArgType::kString, std::move(def), std::move(doc)};
}

// An argument the resolved config leaves out at its default (ArgSpec::quiet_default).
inline ArgSpec quiet(ArgSpec a) {
  a.quiet_default = true;
  return a;
}

template <class M>
class ModelDecl {
 public:
  using ArgCheck = std::function<void(const ModelArgs&)>;
  using TpPlanFn = std::function<TpPlan(const ModelArgs&, bool sequence_parallel)>;
  using TpCheck = std::function<void(const ModelArgs&, int64_t tp, bool sequence_parallel)>;

  ModelDecl(std::string name, std::string doc) {
    spec_.name = std::move(name);
    spec_.doc = std::move(doc);
  }
  // The YAML arguments, in the order `composer plan` prints them.
  ModelDecl& args(std::vector<ArgSpec> a) {
    spec_.args = std::move(a);
    return *this;
  }
  // Throws ArgError naming the argument at fault.
  ModelDecl& check(ArgCheck c) {
    spec_.check = std::move(c);
    return *this;
  }
  ModelDecl& build(std::function<std::shared_ptr<M>(const ModelArgs&)> make) {
    make_ = std::move(make);
    return *this;
  }
  // The pieces, run in order, compute M's forward (PipelinePiece).
  ModelDecl& pipeline(std::vector<PipelinePiece> (M::*pieces)()) {
    spec_.pipeline = [pieces](Model& m) { return (static_cast<M&>(m).*pieces)(); };
    return *this;
  }
  // M's attention reads `slot` for a sequence split; `check` says what context
  // parallelism needs of the arguments (throws ArgError).
  ModelDecl& context_parallel(nn::SequenceSlot* (M::*slot)(), ArgCheck check) {
    spec_.sequence_slot = [slot](Model& m) { return (static_cast<M&>(m).*slot)(); };
    spec_.cp_check = std::move(check);
    return *this;
  }
  // The plan for sequence_parallel true and false, and the divisibility it needs.
  ModelDecl& tp_plan(TpPlanFn plan, TpCheck check) {
    spec_.tp_plan = std::move(plan);
    spec_.tp_check = std::move(check);
    return *this;
  }
  // One plan for any arguments, with no sequence-parallel variant.
  ModelDecl& tp_plan(TpPlan plan) {
    static constexpr const char* kNoSp = "set sequence_parallel: false";
    return tp_plan([plan](const ModelArgs&, bool) { return plan; },
                   [name = spec_.name](const ModelArgs&, int64_t, bool sp) {
                     if (sp) throw ArgError("", "model " + name + " has no sequence-parallel plan; " + kNoSp);
                   });
  }
  // The Linear whose outputs are the vocabulary's logits (loss parallel).
  ModelDecl& logits(std::string module) {
    spec_.logits = std::move(module);
    return *this;
  }

  // The routed experts per mixture-of-experts block under the arguments (0: none).
  ModelDecl& experts(std::function<int64_t(const ModelArgs&)> count) {
    spec_.experts = std::move(count);
    return *this;
  }

  // The family's Hugging Face adapter (models/hf_adapter.h).
  ModelDecl& hf(std::shared_ptr<const HfAdapter> adapter) {
    spec_.hf = std::move(adapter);
    return *this;
  }

  // Every model `build` returns carries the declared pieces and slot.
  operator ModelSpec() const {
    TORCH_INTERNAL_ASSERT(make_, "model ", spec_.name, " is declared without build");
    ModelSpec s = spec_;
    s.build = [make = make_, pieces = spec_.pipeline, slot = spec_.sequence_slot](const ModelArgs& a) -> ModelPtr {
      std::shared_ptr<M> m = make(a);
      m->bind_declared(pieces, slot);
      return m;
    };
    return s;
  }

 private:
  ModelSpec spec_;
  std::function<std::shared_ptr<M>(const ModelArgs&)> make_;
};

}  // namespace composer::models

#include "parallelisms/activation_checkpoint.h"

#include "parallelisms/parallel.h"

#include <unordered_map>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <unordered_map>

#include "models/layers.h"
#include "models/saved_ops.h"
#include "models/select.h"
#include "parallelisms/comm/trace_span.h"

namespace composer::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One tensor a layer of the unit computes with: the layer, its registered
// parameter and which input of the checkpointed function carries the view.
struct Use {
  nn::Module* module;
  torch::Tensor param;
  size_t input;
};

// What a checkpointed forward keeps for its recompute.
struct Recompute : torch::CustomClassHolder {
  nn::Module::Forward forward;
  std::vector<torch::Tensor> views;  // inputs 1..: the tensors the layers computed with
  std::vector<Use> uses;
  c10::Device device = c10::kCPU;            // the unit's input's: whose generator its dropout draws from
  torch::Tensor rng_state;                   // that generator's state when forward began
  torch::Tensor rng_bytes;                   // a dry run's stand-in for it on meta, so its bytes count
  nn::WeightGradRecords* records = nullptr;  // a zero-bubble stage's records, open at forward
  std::atomic<int64_t>* recomputes = nullptr;
  std::atomic<int64_t>* kept_taken = nullptr;  // mode op: ops whose kept output a recompute took back
  std::unique_ptr<nn::SavedOps> saved;       // mode op: the outputs forward kept; null in mode full
};

// The generator random ops on `device` draw from: the CPU's, or the GPU's
// own (a meta tensor in a dry run stands for a CPU one).
at::Generator generator_of(c10::Device device) {
  return device.is_cuda() ? at::globalContext().defaultGenerator(device) : at::detail::getDefaultCPUGenerator();
}

torch::Tensor rng_state(c10::Device device) {
  auto gen = generator_of(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(c10::Device device, const torch::Tensor& state) {
  auto gen = generator_of(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// In a dry run (meta `input`): a meta tensor as large as the CPU tensor `t`,
// which the meta count would otherwise miss.
torch::Tensor meta_like(const torch::Tensor& t, const torch::Tensor& input) {
  return input.is_meta() ? torch::empty(t.sizes(), t.options().device(torch::kMeta)) : torch::Tensor();
}

// Runs the unit's forward again with grad enabled: on `input`, with the
// layers seeing `leaves` in place of the views they computed with, the
// generator at its forward-time state, and the forward's deferred-weight
// scope open. The layers' views and the generator are restored afterwards.
torch::Tensor recompute(Recompute& r, const torch::Tensor& input, const std::vector<torch::Tensor>& leaves) {
  std::vector<torch::Tensor> before;
  for (const Use& u : r.uses) {
    before.push_back(u.module->param(u.param));
    u.module->set_view(u.param, leaves[u.input]);
  }
  auto restore = [&](const torch::Tensor& rng) {
    for (size_t i = 0; i < r.uses.size(); ++i) {
      const Use& u = r.uses[i];
      if (before[i].unsafeGetTensorImpl() == u.param.unsafeGetTensorImpl()) {
        u.module->clear_view(u.param);
      } else {
        u.module->set_view(u.param, before[i]);
      }
    }
    set_rng_state(r.device, rng);
  };
  const torch::Tensor now = rng_state(r.device);
  const torch::Tensor now_bytes = meta_like(now, input);
  set_rng_state(r.device, r.rng_state);
  torch::Tensor y;
  try {
    torch::AutoGradMode grad(true);
    nn::DeferWeightGrads defer(r.records);
    nn::SavedOps::Scope replay(r.saved.get(), /*replay=*/true);
    y = r.forward(input);
    if (r.saved) {
      r.kept_taken->fetch_add(r.saved->taken());
      r.saved->clear();
    }
  } catch (...) {
    restore(now);
    throw;
  }
  restore(now);
  return y;
}

// Forward: the unit's forward without a graph. Backward: recompute, then the
// gradients of the output back to the input and to every tensor the layers
// computed with.
struct CheckpointFn : torch::autograd::Function<CheckpointFn> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<Recompute> r) {
    ctx->save_for_backward({inputs[0]});
    torch::Tensor y;
    {
      nn::SavedOps::Scope record(r->saved.get(), /*replay=*/false);
      y = r->forward(inputs[0]);
    }
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(r));
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto r = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const size_t n = r->views.size() + 1;
    std::vector<torch::Tensor> leaves(n);
    leaves[0] = x.detach();
    if (ctx->needs_input_grad(0)) leaves[0].requires_grad_(true);
    {
      // Aliases, not detached copies: a Linear that defers its weight
      // gradient to a W step records the alias, whose graph leads on to the
      // parameter.
      torch::AutoGradMode grad(true);
      for (size_t k = 1; k < n; ++k) leaves[k] = r->views[k - 1].view_as(r->views[k - 1]);
    }
    torch::Tensor y;
    {
      TraceSpan span([] { return std::string("recompute"); });
      y = recompute(*r, leaves[0], leaves);
    }
    r->recomputes->fetch_add(1);
    variable_list out(n + 1);  // the last: the Recompute argument
    std::vector<torch::Tensor> wrt;
    std::vector<size_t> at;
    for (size_t k = 0; k < n; ++k) {
      if (leaves[k].requires_grad() && (k == 0 || ctx->needs_input_grad(k))) {
        wrt.push_back(leaves[k]);
        at.push_back(k);
      }
    }
    if (!y.requires_grad() || wrt.empty() || !grads[0].defined()) return out;
    auto g = torch::autograd::grad({y}, wrt, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    for (size_t i = 0; i < at.size(); ++i) out[at[i]] = g[i];
    return out;
  }
};

struct Unit {
  std::vector<std::pair<nn::Module*, torch::Tensor>> uses;  // every (layer, parameter) inside the unit
  std::shared_ptr<std::atomic<int64_t>> recomputes, kept_taken;
  unsigned kept_ops = 0;  // mode op: the kinds whose outputs forward keeps (nn::SavedOps::Kind)
  int64_t ops_every = 1;
};

torch::Tensor checkpointed(const Unit& unit, const torch::Tensor& x, const nn::Module::Forward& forward) {
  if (!torch::GradMode::is_enabled()) return forward(x);
  auto r = c10::make_intrusive<Recompute>();
  std::vector<torch::Tensor> inputs{x};
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (const auto& [m, p] : unit.uses) {
    const torch::Tensor& v = m->param(p);
    if (!v.defined() || !v.requires_grad()) continue;
    auto [it, fresh] = index.emplace(v.unsafeGetTensorImpl(), inputs.size());
    if (fresh) inputs.push_back(v);
    r->uses.push_back({m, p, it->second});
  }
  if (!x.requires_grad() && inputs.size() == 1) return forward(x);  // nothing to differentiate
  r->views.assign(inputs.begin() + 1, inputs.end());
  r->forward = forward;
  r->device = x.device();
  r->rng_state = rng_state(r->device);
  r->rng_bytes = meta_like(r->rng_state, x);
  r->records = nn::DeferWeightGrads::active();
  r->recomputes = unit.recomputes.get();
  r->kept_taken = unit.kept_taken.get();
  if (unit.kept_ops) r->saved = std::make_unique<nn::SavedOps>(unit.kept_ops, unit.ops_every);
  return CheckpointFn::apply(at::TensorList(inputs), r)[0];
}

}  // namespace

std::optional<FieldError> ActivationCheckpointingConfig::check(const std::set<std::string>& given) const {
  if (units.empty()) {
    return FieldError{"", "activation_checkpointing needs units: the modules to checkpoint, as FQN patterns (e.g. "
                          "units: [layers.*])"};
  }
  if (mode == CheckpointMode::kFull) {
    for (const char* key : {"ops", "ops_every"}) {
      if (given.count(key)) {
        return FieldError{key, std::string(key) + " chooses what mode op keeps; mode full keeps nothing inside a "
                               "unit: add mode: op, or remove " + key};
      }
    }
  }
  if (ops.empty()) return FieldError{"ops", "mode op needs ops to keep (linear, attention); for none use mode: full"};
  for (const auto& op : ops) {
    if (op != "linear" && op != "attention") {
      return FieldError{"ops", "unknown op '" + op + "'; valid ops: linear, attention"};
    }
  }
  return std::nullopt;
}

unsigned ActivationCheckpointingConfig::kept_ops() const {
  unsigned kinds = 0;
  for (const auto& op : ops) kinds |= op == "linear" ? nn::SavedOps::kLinear : nn::SavedOps::kAttention;
  return kinds;
}

std::vector<std::string> checkpoint_units(models::Model& model, const ActivationCheckpointingConfig& options) {
  return checkpoint_units(nn::named_modules(model), options);
}

std::vector<std::string> checkpoint_units(const models::NamedModules& modules, const ActivationCheckpointingConfig& options) {
  std::vector<std::string> out;
  auto matches = models::select_modules(modules, options.units);
  for (size_t i = 0; i < matches.size(); ++i) {
    if ((static_cast<int64_t>(i) + 1) % options.every == 0) out.push_back(matches[i].first);
  }
  return out;
}

std::optional<std::string> check_checkpoint_units(models::Model& model, const ActivationCheckpointingConfig& options) {
  auto modules = nn::named_modules(model);
  for (const auto& pattern : options.units) {
    bool found = false;
    for (auto& [name, m] : modules) found = found || (!name.empty() && models::fqn_matches(pattern, name));
    if (!found) return pattern + ": unit pattern matches no module of " + model.type();
  }
  const auto matches = models::select_modules(model, options.units);
  if (options.every > static_cast<int64_t>(matches.size())) {
    return "every " + std::to_string(options.every) + " is more than the " + std::to_string(matches.size()) +
           " matching units, so nothing would be checkpointed; use every <= " + std::to_string(matches.size());
  }
  for (const auto& [outer, m] : matches) {
    for (const auto& [inner, n] : matches) {
      if (inner.rfind(outer + ".", 0) == 0) {
        return "units " + outer + " and " + inner + " nest (the inner one would be recomputed twice); " +
               "give patterns that select one of them";
      }
    }
  }
  return std::nullopt;
}

ActivationCheckpoint::ActivationCheckpoint(const std::vector<models::Root>& roots,
                                           const ActivationCheckpointingConfig& options) {
  models::NamedModules modules;  // every root's modules once, the roots' own left out
  std::unordered_set<const nn::Module*> seen;
  for (const auto& root : roots) {
    for (const auto& [name, m] : root.modules) {
      if (m != root.module && seen.insert(m).second) modules.emplace_back(name, m);
    }
  }
  units_ = checkpoint_units(modules, options);
  std::unordered_map<std::string, nn::Module*> by_name(modules.begin(), modules.end());
  for (const auto& name : units_) {
    nn::Module* module = by_name.at(name);
    TORCH_INTERNAL_ASSERT(!module->has_forward_wrapper(), "module ", name, " is checkpointed twice");
    auto unit = std::make_shared<Unit>();
    unit->recomputes = recomputes_;
    unit->kept_taken = kept_taken_;
    if (options.mode == CheckpointMode::kOp) {
      unit->kept_ops = options.kept_ops();
      unit->ops_every = options.ops_every;
    }
    for (auto& [sub_name, sub] : nn::named_modules(*module)) {
      for (auto& item : sub->named_parameters(/*recurse=*/false)) unit->uses.emplace_back(sub, item.value());
    }
    module->set_forward_wrapper([unit](nn::Module&, const torch::Tensor& x, const nn::Module::Forward& forward) {
      return checkpointed(*unit, x, forward);
    });
  }
}

std::unique_ptr<ActivationCheckpoint> apply_activation_checkpointing(const std::vector<models::Root>& roots,
                                                                     const ActivationCheckpointingConfig& options) {
  return std::make_unique<ActivationCheckpoint>(roots, options);
}

std::unique_ptr<ActivationCheckpoint> apply_activation_checkpointing(models::Model& model,
                                                                     const ActivationCheckpointingConfig& options) {
  return apply_activation_checkpointing({models::whole(model)}, options);
}

bool apply(Applying& a, const ActivationCheckpointingConfig& config) {
  a.par.ac = apply_activation_checkpointing(a.par.roots, config);
  a.log("applied activation_checkpointing: " + std::to_string(a.par.ac->units().size()) + " units");
  return false;  // how a unit computes, not where
}

void trace(Tracing&, const ActivationCheckpointingConfig&) {}

}  // namespace composer::parallel

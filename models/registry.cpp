#include "models/registry.h"

#include "models/hf_adapter.h"

namespace composer::models {

const ArgValue& ModelArgs::at(const std::string& name) const {
  auto it = values_.find(name);
  TORCH_INTERNAL_ASSERT(it != values_.end(), "model argument '", name, "' was not resolved");
  return it->second;
}

void require_arg_positive(const ModelArgs& a, const std::string& name) {
  if (a.i(name) <= 0) {
    throw ArgError(name, name + " must be positive, got " + std::to_string(a.i(name)));
  }
}

void require_arg_divides(const ModelArgs& a, const std::string& divisor, const std::string& dividend) {
  int64_t d = a.i(divisor), n = a.i(dividend);
  if (d <= 0 || n % d != 0) {
    throw ArgError(divisor, divisor + " " + std::to_string(d) + " does not divide " + dividend + " " +
                                std::to_string(n) + "; choose a divisor of " + std::to_string(n));
  }
}

TpRule colwise(std::string pattern, Layout input, Layout output) {
  return {std::move(pattern), TpStyle::kColwise, input, output, Layout::replicate()};
}
TpRule rowwise(std::string pattern, Layout input, Layout output) {
  return {std::move(pattern), TpStyle::kRowwise, input, output, Layout::replicate()};
}
TpRule sequence_parallel(std::string pattern) {
  return {std::move(pattern), TpStyle::kSequenceParallel, Layout::shard(1), Layout::shard(1), Layout::shard(1)};
}
TpRule shared_input(std::string pattern) {
  return {std::move(pattern), TpStyle::kSharedInput, Layout::replicate(), Layout::replicate(), Layout::replicate()};
}
TpRule prepare_input(std::string pattern, Layout input, Layout desired) {
  return {std::move(pattern), TpStyle::kPrepareInput, input, desired, desired};
}

bool ModelSpec::has(Capability c) const {
  switch (c) {
    case Capability::kPipeline:
      return static_cast<bool>(pipeline);
    case Capability::kTpPlan:
      return static_cast<bool>(tp_plan);
    case Capability::kContextParallel:
      return cp_check && sequence_slot;
    case Capability::kLogits:
      return !logits.empty();
    case Capability::kExperts:
      return static_cast<bool>(experts);
    case Capability::kHuggingFace:
      return static_cast<bool>(hf);
  }
  return false;
}

// Each model family's file defines its list of declared models. The list is
// explicit, not filled by static registrars: the linker leaves out a static
// library's objects that nothing references, and the order of names in
// messages must not depend on link order. A new family file adds one line to
// kFamilies and its declaration here.
std::vector<ModelSpec> mlp_specs();
std::vector<ModelSpec> transformer_specs();
std::vector<ModelSpec> llama_specs();
std::vector<ModelSpec> composable_specs();
std::vector<ModelSpec> transformer_shared_specs();

namespace {
constexpr std::vector<ModelSpec> (*kFamilies[])() = {mlp_specs, transformer_specs, llama_specs, composable_specs,
                                                     transformer_shared_specs};
}  // namespace

const std::vector<ModelSpec>& registry() {
  static const std::vector<ModelSpec> specs = [] {
    std::vector<ModelSpec> all;
    for (auto family : kFamilies) {
      for (auto& s : family()) all.push_back(std::move(s));
    }
    return all;
  }();
  return specs;
}

const ModelSpec* find_model(const std::string& name) {
  for (const auto& s : registry()) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

const ModelSpec* find_hf_model(const std::string& model_type) {
  for (const auto& s : registry()) {
    if (!s.hf) continue;
    for (const auto& t : s.hf->model_types()) {
      if (t == model_type) return &s;
    }
  }
  return nullptr;
}

std::string listed_hf_model_types() {
  std::string out;
  for (const auto& s : registry()) {
    if (!s.hf) continue;
    for (const auto& t : s.hf->model_types()) out += (out.empty() ? "" : ", ") + ("\"" + t + "\" (model " + s.name + ")");
  }
  return out;
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& s : registry()) names.push_back(s.name);
  return names;
}

std::vector<std::string> names_with(Capability c) {
  std::vector<std::string> names;
  for (const auto& s : registry()) {
    if (s.has(c)) names.push_back(s.name);
  }
  return names;
}

std::string listed_names_with(Capability c) {
  std::string out;
  for (const auto& name : names_with(c)) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace composer::models

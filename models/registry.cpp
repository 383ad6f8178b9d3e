#include "models/registry.h"

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
TpRule prepare_input(std::string pattern, Layout input, Layout desired) {
  return {std::move(pattern), TpStyle::kPrepareInput, input, desired, desired};
}

const std::vector<ModelSpec>& registry() {
  static const std::vector<ModelSpec> specs = [] {
    std::vector<ModelSpec> all;
    for (auto family : {mlp_specs, transformer_specs, llama_specs, composable_specs,
                        transformer_shared_specs}) {
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

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& s : registry()) names.push_back(s.name);
  return names;
}

}  // namespace composer::models

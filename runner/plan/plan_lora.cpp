#include "runner/plan/plan_lora.h"

#include <set>

#include "models/select.h"

namespace composer {

std::vector<std::pair<std::string, nn::Linear*>> lora_layers(nn::Module& model, const LoraConfig& l) {
  std::set<nn::Module*> chosen;
  for (const auto& pattern : l.targets) {
    const auto selected = models::select_modules(model, {pattern});
    if (selected.empty()) {
      throw ConfigError(l.targets_ref, "'" + pattern + "' selects no module of the model; name modules by their "
                                       "FQNs ('*' within a dotted segment, '**' across), e.g. layers.*.attention.wq");
    }
    for (const auto& [name, m] : selected) {
      bool linear = false;
      for (const auto& [sub, inner] : nn::named_modules(*m)) {
        if (dynamic_cast<nn::Linear*>(inner)) chosen.insert(inner), linear = true;
      }
      if (!linear) {
        throw ConfigError(l.targets_ref, "'" + pattern + "' selects " + name + ", which holds no Linear layer (LoRA "
                                         "adapts Linear layers; routed experts are not Linear layers and get no "
                                         "adapters); name Linear layers or modules holding them");
      }
    }
  }
  std::vector<std::pair<std::string, nn::Linear*>> out;
  for (const auto& [name, m] : nn::named_modules(model)) {
    if (chosen.count(m)) out.emplace_back(name, static_cast<nn::Linear*>(m));
  }
  return out;
}

void attach_lora(nn::Module& model, const std::optional<LoraConfig>& l) {
  if (!l) return;
  for (auto& [name, layer] : lora_layers(model, *l)) layer->add_lora(l->rank, l->alpha, l->dropout);
}

bool is_lora_name(const std::string& name) {
  auto ends = [&](const std::string& s) {
    return name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".lora_A") || ends(".lora_B");
}

std::string lora_weight(const std::string& adapter) {
  return adapter.substr(0, adapter.size() - 7) + ".weight";  // less ".lora_A" or ".lora_B"
}

std::function<bool(const std::string&)> drawn_adapters(const ExperimentConfig& c) {
  if (!c.train.lora || !c.model.lora_from.empty()) return {};
  return is_lora_name;
}

}  // namespace composer

// train.lora (PEFT's LoRA): which Linear layers get adapters, attached to a built model.
#pragma once
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/layers.h"
#include "runner/config/config.h"

namespace composer {

// The Linear layers inside the modules train.lora.targets selects, each once, in the model's module
// order; refuses (ConfigError naming train.lora.targets) a pattern that selects nothing, or a module
// that holds no Linear layer.
std::vector<std::pair<std::string, nn::Linear*>> lora_layers(nn::Module& model, const LoraConfig& l);

// Gives each of them its adapter (nn::Linear::add_lora), in that order, so the draws do not depend
// on the order of the patterns. Nothing without train.lora.
void attach_lora(nn::Module& model, const std::optional<LoraConfig>& l);

// Whether a parameter name is an adapter's (<layer>.lora_A or <layer>.lora_B).
bool is_lora_name(const std::string& name);
// The weight an adapter belongs to: <layer>.weight of <layer>.lora_A or <layer>.lora_B.
std::string lora_weight(const std::string& adapter);

// The parameters a run draws rather than reads from model.init_from or from_hf: train.lora's adapters,
// unless model.lora_from holds them; none (an empty function) otherwise.
std::function<bool(const std::string&)> drawn_adapters(const ExperimentConfig& c);

}  // namespace composer

// The model registry: every model, declared in its own file (model_decl.h), by
// name, and the questions the planner asks of the registered models.
#pragma once
#include <string>
#include <vector>

#include "models/model.h"

namespace composer::models {

// Every registered model, in registration order (registry.cpp's family list,
// then each family's own list).
const std::vector<ModelSpec>& registry();

// The spec named `name`, or nullptr.
const ModelSpec* find_model(const std::string& name);

std::vector<std::string> model_names();

// The spec whose Hugging Face adapter reads config.json's `model_type`, or nullptr.
const ModelSpec* find_hf_model(const std::string& model_type);
// Every model_type the adapters read, for messages: "llama" (model llama), "mixtral" (model llama).
std::string listed_hf_model_types();

// The names of the registered models that have `c`, in registration order.
std::vector<std::string> names_with(Capability c);

// The same names as one list for messages: "transformer, llama".
std::string listed_names_with(Capability c);

}  // namespace composer::models

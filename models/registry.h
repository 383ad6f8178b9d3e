// The model registry: every model family registers its ModelSpecs here by name.
#pragma once
#include <string>
#include <vector>

#include "models/model.h"

namespace composer::models {

const std::vector<ModelSpec>& registry();

// The spec named `name`, or nullptr.
const ModelSpec* find_model(const std::string& name);

std::vector<std::string> model_names();

// Each family file defines its specs.
std::vector<ModelSpec> mlp_specs();
std::vector<ModelSpec> transformer_specs();
std::vector<ModelSpec> llama_specs();
std::vector<ModelSpec> composable_specs();
std::vector<ModelSpec> transformer_shared_specs();

}  // namespace composer::models

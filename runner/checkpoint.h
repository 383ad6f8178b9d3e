// Model weights by fully-qualified name: strict loading (missing, unexpected
// and mis-shaped tensors are errors that name them) and saving as safetensors.
#pragma once
#include <string>

#include "models/model.h"
#include "runner/safetensors.h"

namespace composer {

// The model's parameters (each tensor once), detached, by FQN.
NamedTensors snapshot_params(models::Model& model);

// Copies every tensor of `path` into the parameter of the same name.
void load_weights(models::Model& model, const std::string& path);

void save_weights(models::Model& model, const std::string& path);

}  // namespace composer

// debug's checks that need the model: the module a fault is injected into.
#pragma once
#include "models/module.h"
#include "runner/config/config.h"

namespace composer {

// Refuses, at debug.inject_module, a name that is no module's FQN in `model`
// (with the nearest names).
void check_inject_module(const ExperimentConfig& c, nn::Module& model);

}  // namespace composer

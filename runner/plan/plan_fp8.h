// train.fp8 (models/float8.h): which Linear layers compute in float8, and the planner's checks of them.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "models/layers.h"
#include "runner/config/config.h"

namespace composer {

// The Linear layers inside the modules train.fp8.modules selects (each once, in the model's order).
std::vector<std::pair<std::string, nn::Linear*>> fp8_layers(nn::Module& model, const Fp8Config& f);

// Refuses, at train.fp8, what the float8 layers cannot compute: no layer selected; a zero-bubble
// pipeline schedule (its deferred weight gradients are computed in high precision); on cuda, a
// matmul dimension that is not a multiple of 16 (cuBLAS's float8 kernels need it): each layer's
// features on each tensor-parallel rank, and the rows of a microbatch on a rank. Returns the plan's
// summary line ("" without train.fp8).
std::string plan_fp8(const ExperimentConfig& c, nn::Module& model, int64_t rows_per_microbatch, int64_t tp_size);

}  // namespace composer

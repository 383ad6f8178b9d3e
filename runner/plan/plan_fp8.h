// train.fp8 (models/float8.h): which Linear layers compute in float8, and the planner's checks of them.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "models/layers.h"
#include "parallelisms/comm/mesh.h"
#include "runner/config/config.h"

namespace composer {

// The Linear layers inside the modules train.fp8.modules selects (each once, in the model's order).
std::vector<std::pair<std::string, nn::Linear*>> fp8_layers(nn::Module& model, const Fp8Config& f);

// Marks the selected layers float8; call before the transforms (tensor_parallel installs its amax
// reduction on the layers it shards).
void mark_fp8_layers(nn::Module& model, const std::optional<Fp8Config>& f);  // nothing without train.fp8

// After the transforms: each float8 layer's input and output-gradient scales become those of the
// step's whole microbatch, as one device computes them: the largest magnitude over the ranks that
// split its samples (`batch`, the data-parallel group) and its sequences (`sequence`, context
// parallelism's). Either may be null (no such split).
void reduce_fp8_scales(nn::Module& model, const std::optional<Fp8Config>& f, parallel::Group* batch,
                       parallel::Group* sequence);

// Refuses, at train.fp8, what the float8 layers cannot compute: no layer selected; a zero-bubble
// pipeline schedule (its deferred weight gradients are computed in high precision); data
// parallelism with several microbatches (a rank's microbatch holds other samples than one device's,
// so its scales would differ); on cuda, a
// matmul dimension that is not a multiple of 16 (cuBLAS's float8 kernels need it): each layer's
// features on each tensor-parallel rank, and the rows of a microbatch on a rank. Returns the plan's
// summary line ("" without train.fp8).
std::string plan_fp8(const ExperimentConfig& c, nn::Module& model, int64_t rows_per_microbatch, int64_t tp_size,
                     int64_t dp_size, int64_t microbatches);

}  // namespace composer

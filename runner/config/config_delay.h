// debug.delay, a field type of its own: one mapping {point, ms, ranks} or a
// list of them, each sleeping `ms` milliseconds at a named point of the step
// on the given ranks (read_value and value_json in runner/config/field_walk.h).
#pragma once
#include <optional>
#include <vector>

#include "runner/config/field_walk.h"

namespace composer {

// The first rank of `delays` outside a `world_size`-rank mesh, keyed below
// debug ("delay[i].ranks"; ref_at reads [0] of a mapping written alone as the mapping).
std::optional<FieldError> delay_ranks_error(const std::vector<parallel::Delay>& delays, int64_t world_size);

}  // namespace composer

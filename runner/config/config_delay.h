// Reading debug.delay: one mapping {point, ms, ranks} or a list of them, each
// sleeping `ms` milliseconds at a named point of the step on the given ranks.
#pragma once
#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "parallelisms/comm/delay.h"
#include "runner/config/yaml_reader.h"

namespace composer {

// `node` is debug.delay (at `path`); ranks must be below `world_size`.
std::vector<parallel::Delay> read_delays(const YAML::Node& node, const std::string& path, const ReadContext& ctx,
                                         int64_t world_size);

}  // namespace composer

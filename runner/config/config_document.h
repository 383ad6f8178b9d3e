// The config document before its sections are read: keys given twice are
// errors (yaml-cpp would keep one silently), and --set overrides are applied
// to the YAML tree by path (train.steps, parallelize[0].fully_shard.units).
#pragma once
#include <yaml-cpp/yaml.h>

#include <string>

#include "runner/config/yaml_reader.h"

namespace composer {

// Throws ConfigError naming both places of a key that repeats in a mapping of `doc`.
void check_unique_keys(const YAML::Node& doc, const std::string& file);

// Applies one "path=value" override to `root` (the value is YAML); records it
// in ctx.overrides, and throws UserError for a malformed, repeated or
// unreachable path.
void apply_override(YAML::Node& root, const std::string& text, ReadContext& ctx);

}  // namespace composer

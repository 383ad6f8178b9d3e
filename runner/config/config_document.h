// The config document before its sections are read: keys given twice are
// errors (yaml-cpp would keep one silently), and --set overrides are applied
// to the YAML tree by path (train.steps, parallelize[0].fully_shard.units).
#pragma once
#include <yaml-cpp/yaml.h>

#include <cstddef>
#include <string>

#include "runner/config/yaml_reader.h"

namespace composer {

// The most YAML nodes a config may hold once its aliases are followed. Anchors
// and aliases (&name, *name) share a node, so a few hundred bytes that nest
// them ("billion laughs") stand for billions of nodes; the largest real config
// has a few hundred.
inline constexpr size_t kMaxConfigNodes = 100000;
// The deepest nesting a config may have; an alias inside the node it names
// (`a: &a [*a]`) nests forever.
inline constexpr size_t kMaxConfigDepth = 64;

// Throws ConfigError naming both places of a key that repeats in a mapping of `doc`.
void check_unique_keys(const YAML::Node& doc, const std::string& file);

// Applies one "path=value" override to `root` (the value is YAML); records it
// in ctx.overrides, and throws UserError for a malformed, repeated or
// unreachable path.
void apply_override(YAML::Node& root, const std::string& text, ReadContext& ctx);

}  // namespace composer

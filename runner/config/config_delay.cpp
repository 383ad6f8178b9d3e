#include "runner/config/config_delay.h"

namespace composer {
namespace {

parallel::DelayPoint read_point(YamlMap& m) {
  std::string s;
  m.require("point", s);
  std::vector<std::string> names;
  for (const auto& n : parallel::delay_point_names()) {
    if (s == n.name) return n.point;
    names.push_back(n.name);
  }
  throw ConfigError(m.ref("point"), "unknown delay point '" + s + "'; valid points: " + YamlMap::join(names));
}

parallel::Delay read_delay(const YAML::Node& node, const std::string& path, const ReadContext& ctx,
                           int64_t world_size) {
  YamlMap m(node, path, ctx);
  if (!node.IsMap()) {
    throw ConfigError(m.self_ref(), "expected a delay {point: NAME, ms: MILLISECONDS, ranks: [R, ...]}");
  }
  parallel::Delay d;
  d.point = read_point(m);
  m.require("ms", d.ms);
  require_positive(m.ref("ms"), static_cast<double>(d.ms), "ms");
  m.get("ranks", d.ranks);
  for (int64_t r : d.ranks) {
    if (r < 0 || r >= world_size) {
      throw ConfigError(m.ref("ranks"), "rank " + std::to_string(r) + " is not in the mesh's " +
                                            std::to_string(world_size) + " ranks; use ranks 0 to " +
                                            std::to_string(world_size - 1) + " (or leave ranks out for every rank)");
    }
  }
  m.finish();
  return d;
}

}  // namespace

std::vector<parallel::Delay> read_delays(const YAML::Node& node, const std::string& path, const ReadContext& ctx,
                                         int64_t world_size) {
  std::vector<parallel::Delay> out;
  if (!node.IsSequence()) {
    out.push_back(read_delay(node, path, ctx, world_size));
    return out;
  }
  for (size_t i = 0; i < node.size(); ++i) {
    out.push_back(read_delay(node[i], path + "[" + std::to_string(i) + "]", ctx, world_size));
  }
  return out;
}

}  // namespace composer

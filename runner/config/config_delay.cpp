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

parallel::Delay read_delay(const YAML::Node& node, const std::string& path, const ReadContext& ctx) {
  YamlMap m(node, path, ctx);
  if (!node.IsMap()) {
    throw ConfigError(m.self_ref(), "expected a delay {point: NAME, ms: MILLISECONDS, ranks: [R, ...]}");
  }
  parallel::Delay d;
  d.point = read_point(m);
  m.require("ms", d.ms);
  require_positive(m.ref("ms"), static_cast<double>(d.ms), "ms");
  m.get("ranks", d.ranks);
  m.finish();
  return d;
}

}  // namespace

void read_value(YamlMap& m, const std::string& key, std::vector<parallel::Delay>& out) {
  const YAML::Node node = m.node(key);
  const std::string path = m.child_path(key);
  out.clear();
  if (!node.IsSequence()) {
    out.push_back(read_delay(node, path, m.context()));
    return;
  }
  for (size_t i = 0; i < node.size(); ++i) out.push_back(read_delay(node[i], path + "[" + std::to_string(i) + "]", m.context()));
}

nlohmann::json value_json(const std::vector<parallel::Delay>& delays) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& d : delays) j.push_back({{"point", parallel::name_of(d.point)}, {"ms", d.ms}, {"ranks", d.ranks}});
  return j;
}

std::optional<FieldError> delay_ranks_error(const std::vector<parallel::Delay>& delays, int64_t world_size) {
  for (size_t i = 0; i < delays.size(); ++i) {
    for (int64_t r : delays[i].ranks) {
      if (r >= 0 && r < world_size) continue;
      return FieldError{"delay[" + std::to_string(i) + "].ranks",
                        "rank " + std::to_string(r) + " is not in the mesh's " + std::to_string(world_size) +
                            " ranks; use ranks 0 to " + std::to_string(world_size - 1) +
                            " (or leave ranks out for every rank)"};
    }
  }
  return std::nullopt;
}

}  // namespace composer

#include "runner/config/config_document.h"

#include <functional>
#include <map>
#include <sstream>

#include "runner/base/errors.h"

namespace composer {
namespace {

struct KeyWalk {
  std::function<SourceRef(const YAML::Node&, const std::string&)> ref_at;
  std::function<std::string(const YAML::Node&)> place;
  size_t nodes = 0;
  size_t depth = 0;
};

// YAML forbids a key twice in one mapping, but yaml-cpp keeps both and reads
// one of them: an error at the second naming the first's place instead.
// `walk.place(first)` names a place (its line and column, or its column in the
// --set override). Refuses a document that expands past
// kMaxConfigNodes, at the first node past the bound.
void check_unique_keys(const YAML::Node& node, const std::string& path, KeyWalk& walk) {
  if (++walk.nodes > kMaxConfigNodes) {
    throw ConfigError(walk.ref_at(node, path.empty() ? "(document)" : path),
                      "the config expands to more than " + std::to_string(kMaxConfigNodes) +
                          " YAML nodes once its aliases (*name) are followed; write the values out, or alias "
                          "fewer nested anchors (&name)");
  }
  if (walk.depth >= kMaxConfigDepth) {
    throw ConfigError(walk.ref_at(node, path),
                      "the config nests deeper than " + std::to_string(kMaxConfigDepth) +
                          " levels (an alias inside the anchor it names, `a: &a [*a]`, nests forever); write the "
                          "values out");
  }
  ++walk.depth;
  if (node.IsMap()) {
    std::map<std::string, YAML::Node> seen;
    for (const auto& kv : node) {
      if (!kv.first.IsScalar()) {
        throw ConfigError(walk.ref_at(kv.first, path.empty() ? "(key)" : path + ".(key)"),
                          "a key must be a plain name, not a mapping, a list or empty; write `name: value`");
      }
      const std::string key = kv.first.Scalar();
      const std::string child = path.empty() ? key : path + "." + key;
      auto [it, fresh] = seen.emplace(key, kv.first);
      if (!fresh) {
        throw ConfigError(walk.ref_at(kv.first, child),
                          "duplicate key '" + key + "', first given " + walk.place(it->second) + "; keep one of them");
      }
      check_unique_keys(kv.second, child, walk);
    }
  } else if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) {
      check_unique_keys(node[i], path + "[" + std::to_string(i) + "]", walk);
    }
  }
  --walk.depth;
}

// The value of `--set path=value`, parsed as YAML; refuses a key given twice in it.
YAML::Node parse_override_value(const std::string& text, const std::string& path, const std::string& value) {
  YAML::Node value_node;
  try {
    value_node = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw UserError("--set " + text + ": the value is not valid YAML: " + e.msg);
  }
  KeyWalk walk{[&](const YAML::Node&, const std::string& p) { return SourceRef{"", 0, 0, p, text}; },
               [](const YAML::Node& n) { return "at column " + std::to_string(n.Mark().column + 1) + " of the value"; }};
  check_unique_keys(value_node, path, walk);
  return value_node;
}

// Takes `cur` one step (`token`, a key with perhaps an [index]) down a --set path, creating a missing mapping on the
// way, or on the last step sets what it names to `value`; `walked` grows by the step, for errors.
void set_path_step(YAML::Node& cur, const std::string& token, bool last, const YAML::Node& value, std::string& walked,
                   const std::string& text) {
  std::string key = token;
  long index = -1;
  auto br = key.find('[');
  if (br != std::string::npos) {
    index = std::strtol(key.c_str() + br + 1, nullptr, 10);
    key = key.substr(0, br);
  }
  walked += (walked.empty() ? "" : ".") + key;
  if (key.empty() || (!cur.IsMap() && !cur.IsNull())) {
    throw UserError("--set " + text + ": '" + walked + "' is not a mapping");
  }
  if (index < 0) {
    if (!last && (!cur[key].IsDefined() || cur[key].IsNull())) cur[key] = YAML::Node(YAML::NodeType::Map);
    if (last) {
      cur[key] = value;
    } else {
      YAML::Node next = cur[key];
      cur.reset(next);
    }
    return;
  }
  YAML::Node seq = cur[key];
  if (!seq.IsSequence() || index >= static_cast<long>(seq.size())) {
    throw UserError("--set " + text + ": " + walked + " has no entry [" + std::to_string(index) + "]");
  }
  walked += "[" + std::to_string(index) + "]";
  if (last) {
    seq[index] = value;
  } else {
    YAML::Node next = seq[index];
    cur.reset(next);
  }
}

}  // namespace

void check_unique_keys(const YAML::Node& doc, const std::string& file) {
  KeyWalk walk{[&](const YAML::Node& n, const std::string& path) {
                 return SourceRef{file, n.Mark().line + 1, n.Mark().column + 1, path, ""};
               },
               [](const YAML::Node& n) {
                 return "at line " + std::to_string(n.Mark().line + 1) + ", column " +
                        std::to_string(n.Mark().column + 1);
               }};
  check_unique_keys(doc, "", walk);
}

void apply_override(YAML::Node& root, const std::string& text, ReadContext& ctx) {
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw UserError("--set " + text + ": expected path=value, e.g. --set train.steps=20");
  }
  std::string path = text.substr(0, eq), value = text.substr(eq + 1);
  YAML::Node value_node = parse_override_value(text, path, value);
  for (const auto& [earlier_path, earlier] : ctx.overrides) {
    if (earlier_path == path) {
      throw UserError("--set " + text + ": " + earlier_path + " is already set by --set " + earlier +
                      "; give each path once");
    }
  }
  YAML::Node cur;
  cur.reset(root);
  std::stringstream ss(path);
  std::string token, walked;
  std::vector<std::string> tokens;
  while (std::getline(ss, token, '.')) tokens.push_back(token);
  for (size_t t = 0; t < tokens.size(); ++t) {
    set_path_step(cur, tokens[t], t + 1 == tokens.size(), value_node, walked, text);
  }
  ctx.overrides.emplace_back(path, text);
}

}  // namespace composer

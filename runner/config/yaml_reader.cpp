#include "runner/config/yaml_reader.h"

#include <algorithm>
#include <sstream>

namespace composer {

static bool starts_with_path(const std::string& path, const std::string& prefix) {
  if (path.compare(0, prefix.size(), prefix) != 0) return false;
  return path.size() == prefix.size() || path[prefix.size()] == '.' || path[prefix.size()] == '[';
}

SourceRef ref_of(const YAML::Node& node, const std::string& path, const ReadContext& ctx) {
  SourceRef r;
  r.file = ctx.file;
  r.path = path;
  for (const auto& [p, text] : ctx.overrides) {
    if (starts_with_path(path, p)) {
      r.override = text;
      return r;
    }
  }
  if (node.IsDefined() && node.Mark().line >= 0) {
    r.line = node.Mark().line + 1;
    r.col = node.Mark().column + 1;
  }
  return r;
}

YamlMap::YamlMap(const YAML::Node& node, std::string path, const ReadContext& ctx)
    : node_(node), path_(std::move(path)), ctx_(ctx) {
  if (node_.IsNull()) return;  // an empty section reads as all defaults
  if (!node_.IsMap()) {
    throw ConfigError(ref_of(node_, path_, ctx_), "expected a mapping of keys to values");
  }
}

bool YamlMap::has(const std::string& key) const {
  known_.insert(key);
  return node_.IsMap() && node_[key].IsDefined() && !node_[key].IsNull();
}

YAML::Node YamlMap::node(const std::string& key) {
  known_.insert(key);
  read_.insert(key);
  return node_[key];
}

std::string YamlMap::child_path(const std::string& key) const {
  return path_.empty() ? key : path_ + "." + key;
}

SourceRef YamlMap::ref(const std::string& key) const {
  return ref_of(node_.IsMap() ? node_[key] : node_, child_path(key), ctx_);
}

void YamlMap::finish() const {
  if (!node_.IsMap()) return;
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    std::string key = it->first.as<std::string>();
    if (read_.count(key)) continue;
    std::vector<std::string> known(known_.begin(), known_.end());
    std::string hint = nearest(key, known);
    SourceRef r = ref_of(it->first, child_path(key), ctx_);
    throw ConfigError(r, "unknown key" + (hint.empty() ? std::string("") : "; did you mean " + hint + "?"));
  }
}

std::string YamlMap::join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out;
}

namespace {
template <class T>
T scalar(const YAML::Node& n, const SourceRef& r, const char* what) {
  if (!n.IsScalar()) throw ConfigError(r, std::string("expected ") + what);
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    throw ConfigError(r, std::string("expected ") + what + ", got '" + n.Scalar() + "'");
  }
}
template <class T>
std::vector<T> sequence(const YAML::Node& n, const SourceRef& r, const char* what) {
  if (!n.IsSequence()) throw ConfigError(r, std::string("expected a list of ") + what);
  std::vector<T> out;
  for (size_t i = 0; i < n.size(); ++i) {
    SourceRef ri = r;
    ri.path += "[" + std::to_string(i) + "]";
    out.push_back(scalar<T>(n[i], ri, what));
  }
  return out;
}
}  // namespace

template <>
int64_t YamlMap::convert<int64_t>(const YAML::Node& n, const std::string& p) const {
  return scalar<int64_t>(n, ref_of(n, p, ctx_), "an integer");
}
template <>
uint64_t YamlMap::convert<uint64_t>(const YAML::Node& n, const std::string& p) const {
  auto r = ref_of(n, p, ctx_);
  if (n.IsScalar() && !n.Scalar().empty() && n.Scalar()[0] == '-') {
    throw ConfigError(r, "expected a non-negative integer, got '" + n.Scalar() + "'");
  }
  return scalar<uint64_t>(n, r, "a non-negative integer");
}
template <>
double YamlMap::convert<double>(const YAML::Node& n, const std::string& p) const {
  return scalar<double>(n, ref_of(n, p, ctx_), "a number");
}
template <>
bool YamlMap::convert<bool>(const YAML::Node& n, const std::string& p) const {
  return scalar<bool>(n, ref_of(n, p, ctx_), "true or false");
}
template <>
std::string YamlMap::convert<std::string>(const YAML::Node& n, const std::string& p) const {
  return scalar<std::string>(n, ref_of(n, p, ctx_), "a string");
}
template <>
std::vector<int64_t> YamlMap::convert<std::vector<int64_t>>(const YAML::Node& n,
                                                           const std::string& p) const {
  return sequence<int64_t>(n, ref_of(n, p, ctx_), "integers");
}
template <>
std::vector<double> YamlMap::convert<std::vector<double>>(const YAML::Node& n,
                                                         const std::string& p) const {
  return sequence<double>(n, ref_of(n, p, ctx_), "numbers");
}
template <>
std::vector<std::string> YamlMap::convert<std::vector<std::string>>(const YAML::Node& n,
                                                                   const std::string& p) const {
  return sequence<std::string>(n, ref_of(n, p, ctx_), "strings");
}

void require_positive(const SourceRef& ref, double value, const std::string& what) {
  if (!(value > 0)) {
    std::ostringstream os;
    os << what << " must be positive, got " << value;
    throw ConfigError(ref, os.str());
  }
}

void require_non_negative(const SourceRef& ref, double value, const std::string& what) {
  if (!(value >= 0)) {
    std::ostringstream os;
    os << what << " must be zero or positive, got " << value;
    throw ConfigError(ref, os.str());
  }
}

}  // namespace composer

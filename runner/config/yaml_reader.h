// Strict, typed reading of YAML maps: every key is read at most once, unknown
// keys are errors with a "did you mean" hint, and every error names the file,
// line, column and YAML path (or the --set override that supplied the value).
#pragma once
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "parallelisms/config_fields.h"
#include "runner/base/errors.h"

namespace composer {

// Shared by every reader of one config: the file name and the paths that
// --set overrides replaced (their errors point at the override).
struct ReadContext {
  std::string file;
  std::vector<std::pair<std::string, std::string>> overrides;  // path, "path=value"
};

SourceRef ref_of(const YAML::Node& node, const std::string& path, const ReadContext& ctx);

class YamlMap {
 public:
  YamlMap(const YAML::Node& node, std::string path, const ReadContext& ctx);

  bool has(const std::string& key) const;
  YAML::Node node(const std::string& key);  // marks the key as read
  std::string child_path(const std::string& key) const;
  SourceRef ref(const std::string& key) const;
  SourceRef self_ref() const { return ref_of(node_, path_, ctx_); }
  const ReadContext& context() const { return ctx_; }

  // Reads `key` into `out` when present (else leaves the default).
  template <class T>
  void get(const std::string& key, T& out) {
    if (has(key)) out = convert<T>(node(key), child_path(key));
  }
  template <class T>
  void require(const std::string& key, T& out) {
    if (!has(key)) throw ConfigError(self_ref(), "missing required key '" + key + "'");
    get(key, out);
  }
  template <class E, size_t N>
  void get_enum(const std::string& key, E& out, const EnumName<E> (&table)[N]) {
    if (!has(key)) return;
    std::string s = convert<std::string>(node(key), child_path(key));
    for (const auto& e : table) {
      if (s == e.name) {
        out = e.value;
        return;
      }
    }
    std::vector<std::string> names;
    for (const auto& e : table) names.push_back(e.name);
    throw ConfigError(ref(key), "unknown value '" + s + "'; valid values: " + join(names));
  }

  // Errors on every key that was not read; call after reading the section.
  void finish() const;

  template <class T>
  T convert(const YAML::Node& n, const std::string& path) const;

  static std::string join(const std::vector<std::string>& items);

 private:
  YAML::Node node_;
  std::string path_;
  const ReadContext& ctx_;
  std::set<std::string> read_;
  mutable std::set<std::string> known_;  // every key asked for: the "did you mean" candidates
};

template <> int64_t YamlMap::convert<int64_t>(const YAML::Node&, const std::string&) const;
template <> uint64_t YamlMap::convert<uint64_t>(const YAML::Node&, const std::string&) const;
template <> double YamlMap::convert<double>(const YAML::Node&, const std::string&) const;
template <> bool YamlMap::convert<bool>(const YAML::Node&, const std::string&) const;
template <> std::string YamlMap::convert<std::string>(const YAML::Node&, const std::string&) const;
template <> std::vector<int64_t> YamlMap::convert<std::vector<int64_t>>(const YAML::Node&,
                                                                     const std::string&) const;
template <> std::vector<double> YamlMap::convert<std::vector<double>>(const YAML::Node&,
                                                                   const std::string&) const;
template <> std::vector<std::string> YamlMap::convert<std::vector<std::string>>(
    const YAML::Node&, const std::string&) const;

// Positive / non-negative checks with one message style.
void require_positive(const SourceRef& ref, double value, const std::string& what);
void require_non_negative(const SourceRef& ref, double value, const std::string& what);

}  // namespace composer

// The walks over a config's field lists (parallelisms/config_fields.h): one
// reader of YAML, one writer of the resolved JSON and one lister of every key
// with its default (the docs' key table test). Every section of the
// experiment config and every transform's Config is read and written by them,
// so a key is declared once, in its struct's fields().
//
// Beyond config_fields.h's field types, a field may be
//  - a section: a struct with fields() (and perhaps check()), read from a
//    nested mapping; an absent section holds its defaults and is still checked;
//  - std::optional of a section: absent, it stays unset and is left out of the JSON;
//  - a list of sections (a mapping alone with kOneOrList);
//  - a type with its own spelling: a read_value(YamlMap&, key, T&) and
//    value_json(const T&) overload declared below (model.args, debug.delay,
//    the tensor-parallel styles, reshard_after_forward, parallelize).
// A section's fields() may also call v.where(key, ref) (ref = where key was
// written, or the section itself for ""; left alone when key is absent) and
// v.refused(key, why) (a key that belongs elsewhere: its error when given).
// check(given) runs after the section's fields are read; its FieldError key
// may be a dotted path below the section ("debug.delay[1].ranks").
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "models/model.h"
#include "parallelisms/comm/delay.h"
#include "parallelisms/transforms.h"
#include "runner/config/yaml_reader.h"

namespace composer {

// FieldRule additions for sections: left out of the JSON when equal to its
// type's default value (T{}), so adding such a key keeps every config hash.
inline constexpr unsigned kOmitDefault = 16;
// Read (by its read_value) even when the key is absent: its defaults depend on other keys.
inline constexpr unsigned kReadAbsent = 32;

struct TransformConfig;

// The field types YAML spells in their own way.
void read_value(YamlMap& m, const std::string& key, models::TpPlan& plan);
void read_value(YamlMap& m, const std::string& key, parallel::ReshardAfterForward& out);
void read_value(YamlMap& model, const std::string& key, models::ModelArgs& args);  // after name and from_hf
void read_value(YamlMap& m, const std::string& key, std::vector<parallel::Delay>& out);
void read_value(YamlMap& root, const std::string& key, std::vector<TransformConfig>& out);
nlohmann::json value_json(const models::TpPlan& plan);
nlohmann::json value_json(const parallel::ReshardAfterForward& r);
nlohmann::json value_json(const models::ModelArgs& args);
nlohmann::json value_json(const std::vector<parallel::Delay>& delays);
nlohmann::json value_json(const std::vector<TransformConfig>& transforms);

// Where `key` (a dotted path below m, with [i] for list entries) was written.
SourceRef ref_at(YamlMap& m, const std::string& key);

namespace fields_detail {
template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};
template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};
struct NoVisit {
  template <class T>
  void operator()(const char*, T&, unsigned = 0) {}
  void where(const char*, SourceRef&) {}
  void refused(const char*, const char*) {}
};
template <class T, class = void>
struct HasFields : std::false_type {};
template <class T>
struct HasFields<T, std::void_t<decltype(std::declval<T&>().fields(std::declval<NoVisit&>()))>> : std::true_type {};
// A list of sections, and an optional section.
template <class T>
struct IsSectionList : std::false_type {};
template <class T>
struct IsSectionList<std::vector<T>> : HasFields<T> {};
template <class T>
struct IsOptionalSection : std::false_type {};
template <class T>
struct IsOptionalSection<std::optional<T>> : HasFields<T> {};
template <class T, class = void>
struct HasCheck : std::false_type {};
template <class T>
struct HasCheck<T, std::void_t<decltype(std::declval<T&>().check(std::declval<const std::set<std::string>&>()))>>
    : std::true_type {};
template <class T, class = void>
struct HasReadValue : std::false_type {};
template <class T>
struct HasReadValue<T, std::void_t<decltype(read_value(std::declval<YamlMap&>(), std::string(), std::declval<T&>()))>>
    : std::true_type {};
template <class T, class = void>
struct HasListExample : std::false_type {};
template <class T>
struct HasListExample<T, std::void_t<decltype(T::kListExample)>> : std::true_type {};
}  // namespace fields_detail

template <class T>
nlohmann::json value_json(const T& v);

// Writes each field's value; null values (an unset optional section, no TP
// styles) and kOmitDefault fields at their default are left out.
struct FieldWriter {
  nlohmann::json& j;
  template <class T>
  void operator()(const char* key, const T& v, unsigned rules = kAnyValue) {
    nlohmann::json x = value_json(v);
    if (x.is_null() || ((rules & kOmitDefault) && x == value_json(T{}))) return;
    j[key] = std::move(x);
  }
  void where(const char*, SourceRef&) {}
  void refused(const char*, const char*) {}
};

// A section as a JSON object of its fields.
template <class S>
nlohmann::json section_json(const S& s) {
  nlohmann::json j = nlohmann::json::object();
  FieldWriter w{j};
  const_cast<S&>(s).fields(w);  // fields() hands out its members; the writer only reads them
  return j;
}

template <class T>
nlohmann::json value_json(const T& v) {
  using namespace fields_detail;
  if constexpr (std::is_enum_v<T>) {
    return lookup(names_of(T{}), v);
  } else if constexpr (HasFields<T>::value) {
    return section_json(v);
  } else if constexpr (IsOptionalSection<T>::value) {
    return v ? section_json(*v) : nlohmann::json();
  } else if constexpr (IsOptional<T>::value) {
    return v ? value_json(*v) : nlohmann::json("");
  } else if constexpr (IsSectionList<T>::value) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& e : v) list.push_back(section_json(e));
    return list;
  } else {
    return v;
  }
}

// Reads each field the YAML map gives, checks its rules and remembers where it was written.
struct FieldReader {
  YamlMap& m;
  std::set<std::string> given;
  std::map<std::string, SourceRef>* refs = nullptr;  // each key given, when the caller keeps them

  template <class T>
  void operator()(const char* key, T& out, unsigned rules = kAnyValue);
  void where(const char* key, SourceRef& ref) {
    if (!*key) ref = m.self_ref();
    else if (m.has(key)) ref = m.ref(key);
  }
  void refused(const char* key, const char* why) {
    if (m.has(key)) throw ConfigError(m.ref(key), why);
  }

 private:
  template <class T>
  void read(const std::string& key, T& out, unsigned rules);
};

// Reads the section S at `node` (`path`): its fields, then its check(); errors on keys it lacks.
template <class S>
void read_section(const YAML::Node& node, const std::string& path, const ReadContext& ctx, S& out,
                  std::map<std::string, SourceRef>* refs = nullptr) {
  YamlMap m(node, path, ctx);
  FieldReader r{m, {}, refs};
  out.fields(r);
  if constexpr (fields_detail::HasCheck<S>::value) {
    if (auto e = out.check(r.given)) throw ConfigError(e->key.empty() ? m.self_ref() : ref_at(m, e->key), e->message);
  }
  m.finish();
}

// A list of sections S at `node`; with kOneOrList a mapping alone is a list of one.
template <class S>
void read_sections(YamlMap& m, const std::string& key, std::vector<S>& out, unsigned rules) {
  const YAML::Node n = m.node(key);
  if ((rules & kOneOrList) && n.IsMap()) {
    out.assign(1, S{});
    read_section(n, m.child_path(key), m.context(), out[0]);
    return;
  }
  if (!n.IsSequence() || n.size() == 0) {
    std::string example = "mappings";
    if constexpr (fields_detail::HasListExample<S>::value) example = S::kListExample;
    throw ConfigError(m.ref(key), "expected a non-empty list of " + example);
  }
  out.assign(n.size(), S{});
  for (size_t i = 0; i < n.size(); ++i) {
    read_section(n[i], m.child_path(key) + "[" + std::to_string(i) + "]", m.context(), out[i]);
  }
}

template <class T>
void FieldReader::operator()(const char* key, T& out, unsigned rules) {
  using namespace fields_detail;
  if (!m.has(key)) {
    if (rules & kRequired) throw ConfigError(m.self_ref(), std::string("missing required key '") + key + "'");
    if constexpr (HasReadValue<T>::value) {
      if (rules & kReadAbsent) read_value(m, key, out);
    } else if constexpr (HasFields<T>::value) {
      read_section(YAML::Node(), m.child_path(key), m.context(), out);  // its defaults, checked
    }
    return;
  }
  given.insert(key);
  if (refs) (*refs)[key] = m.ref(key);
  read(key, out, rules);
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (rules & kPositive) require_positive(m.ref(key), static_cast<double>(out), key);
    if (rules & kNonNegative) require_non_negative(m.ref(key), static_cast<double>(out), key);
  }
}

template <class T>
void FieldReader::read(const std::string& key, T& out, unsigned rules) {
  using namespace fields_detail;
  if constexpr (HasReadValue<T>::value) {
    read_value(m, key, out);
  } else if constexpr (HasFields<T>::value) {
    read_section(m.node(key), m.child_path(key), m.context(), out);
  } else if constexpr (std::is_enum_v<T>) {
    m.get_enum(key, out, names_of(T{}));
  } else if constexpr (IsOptional<T>::value) {
    typename T::value_type v{};
    read(key, v, rules);
    out = std::move(v);
  } else if constexpr (IsSectionList<T>::value) {
    read_sections(m, key, out, rules);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    const YAML::Node n = m.node(key);
    out = (rules & kOneOrList) && !n.IsSequence() ? std::vector<std::string>{m.convert<std::string>(n, m.child_path(key))}
                                                  : m.convert<std::vector<std::string>>(n, m.child_path(key));
  } else {
    m.get(key, out);
  }
}

// Every key below a section with its default as the JSON writes it and its
// rules, by dotted path; optional sections are listed with their defaults,
// lists of sections by their key alone.
struct FieldLister {
  struct Entry {
    nlohmann::json value;
    unsigned rules;
  };
  std::map<std::string, Entry>& out;
  std::string prefix;

  template <class T>
  void operator()(const char* key, T& v, unsigned rules = kAnyValue) {
    using namespace fields_detail;
    const std::string path = prefix + key;
    if constexpr (HasFields<T>::value) {
      FieldLister inner{out, path + "."};
      v.fields(inner);
    } else if constexpr (IsOptionalSection<T>::value) {
      typename T::value_type d{};
      FieldLister inner{out, path + "."};
      d.fields(inner);
    } else {
      out[path] = Entry{value_json(v), rules};
    }
  }
  void where(const char*, SourceRef&) {}
  void refused(const char*, const char*) {}
};

}  // namespace composer

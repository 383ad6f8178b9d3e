// Reading and writing the parallelize section: one walk over each
// transform's field list (parallelisms/config_fields.h) for YAML and one for
// JSON, and the readers of the two field types YAML spells in their own way
// (tensor-parallel styles, reshard_after_forward).
#include "runner/config/parallelize_config.h"

#include "runner/config/field_walk.h"

#include <algorithm>
#include <cstdio>
#include <type_traits>

namespace composer {
namespace {

const EnumName<models::TpStyle> kTpStyles[] = {{models::TpStyle::kColwise, "colwise"},
                                               {models::TpStyle::kRowwise, "rowwise"},
                                               {models::TpStyle::kSequenceParallel, "sequence_parallel"},
                                               {models::TpStyle::kPrepareInput, "prepare_input"},
                                               {models::TpStyle::kSharedInput, "shared_input"}};

// Whether a Config spans mesh dims.
template <class C, class = void>
struct HasMeshDim : std::false_type {};
template <class C>
struct HasMeshDim<C, std::void_t<decltype(std::declval<const C&>().mesh_dim)>> : std::true_type {};

// "replicate" or "shard(D)" with an integer dim (negative from the end).
models::Layout read_layout(YamlMap& m, const std::string& key, models::Layout def) {
  if (!m.has(key)) return def;
  std::string s = m.convert<std::string>(m.node(key), m.child_path(key));
  if (s == "replicate") return models::Layout::replicate();
  int dim = 0;
  char tail = 0;
  if (std::sscanf(s.c_str(), "shard(%d)%c", &dim, &tail) == 2 && tail == 0) return models::Layout::shard(dim);
  if (std::sscanf(s.c_str(), "shard(%d%c", &dim, &tail) == 2 && tail == ')') return models::Layout::shard(dim);
  throw ConfigError(m.ref(key), "unknown layout '" + s + "'; use replicate or shard(DIM), e.g. shard(1) or shard(-1)");
}

std::string layout_name(const models::Layout& l) {
  return l.sharded ? "shard(" + std::to_string(l.dim) + ")" : std::string("replicate");
}

template <class C>
C read_config(YamlMap& m, std::map<std::string, SourceRef>& refs) {
  C c;
  FieldReader r{m, {}, &refs};
  c.fields(r);
  if constexpr (fields_detail::HasCheck<C>::value) {
    if (auto e = c.check(r.given)) throw ConfigError(e->key.empty() ? m.self_ref() : m.ref(e->key), e->message);
  }
  return c;
}

// The registered transforms' keys and readers, by walking the variant's alternatives.
template <size_t... I>
bool read_alternative(std::index_sequence<I...>, const std::string& key, YamlMap& m, TransformConfig& t) {
  return ((key == std::variant_alternative_t<I, parallel::Transform>::kKey
               ? (t.options = read_config<std::variant_alternative_t<I, parallel::Transform>>(m, t.refs), true)
               : false) ||
          ...);
}
constexpr auto kAlternatives = std::make_index_sequence<std::variant_size_v<parallel::Transform>>{};

template <size_t... I>
std::vector<parallel::Transform> all_defaults(std::index_sequence<I...>) {
  return {parallel::Transform(std::variant_alternative_t<I, parallel::Transform>{})...};
}

TransformConfig read_transform(const YAML::Node& node, const std::string& path, const ReadContext& ctx) {
  const std::vector<std::string> kinds = transform_names();
  if (!node.IsMap() || node.size() != 1) {
    throw ConfigError(ref_of(node, path, ctx),
                      "each parallelize entry is a mapping with one key naming the transform: " + YamlMap::join(kinds));
  }
  YamlMap outer(node, path, ctx);
  const std::string key = node.begin()->first.as<std::string>();
  TransformConfig t;
  t.ref = ref_of(node.begin()->first, path, ctx);
  if (std::find(kinds.begin(), kinds.end(), key) == kinds.end()) {
    const std::string hint = nearest(key, kinds);
    throw ConfigError(t.ref, "unknown transform '" + key + "'" + (hint.empty() ? "" : "; did you mean " + hint + "?") +
                                 " valid transforms: " + YamlMap::join(kinds));
  }
  YamlMap m(outer.node(key), path + "." + key, ctx);
  read_alternative(kAlternatives, key, m, t);
  m.finish();
  return t;
}

}  // namespace

// tensor_parallel's styles: a list of {module, style, input, output, desired_input}.
void read_value(YamlMap& parent, const std::string& key, models::TpPlan& plan) {
  YAML::Node list = parent.node(key);
  const std::string path = parent.child_path(key);
  if (!list.IsSequence()) {
    throw ConfigError(parent.ref(key), "expected a list like - {module: net1, style: colwise}");
  }
  for (size_t i = 0; i < list.size(); ++i) {
    YamlMap m(list[i], path + "[" + std::to_string(i) + "]", parent.context());
    std::string pattern;
    m.require("module", pattern);
    models::TpStyle style = models::TpStyle::kColwise;
    if (!m.has("style")) throw ConfigError(m.self_ref(), "missing required key 'style'");
    m.get_enum("style", style, kTpStyles);
    models::TpRule r;
    switch (style) {
      case models::TpStyle::kColwise: r = models::colwise(pattern); break;
      case models::TpStyle::kRowwise: r = models::rowwise(pattern); break;
      case models::TpStyle::kSequenceParallel: r = models::sequence_parallel(pattern); break;
      case models::TpStyle::kPrepareInput:
        r = models::prepare_input(pattern, models::Layout::shard(1), models::Layout::replicate());
        break;
      case models::TpStyle::kSharedInput: r = models::shared_input(pattern); break;
    }
    r.input = read_layout(m, "input", r.input);
    r.output = read_layout(m, "output", r.output);
    r.desired_input = read_layout(m, "desired_input", r.desired_input);
    m.finish();
    plan.push_back(r);
  }
}

// true, false or a group size N >= 1 (whether N divides the shard group is the planner's check).
void read_value(YamlMap& m, const std::string& key, parallel::ReshardAfterForward& out) {
  const YAML::Node n = m.node(key);
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  bool flag = false;
  if (n.IsScalar() && YAML::convert<bool>::decode(n, flag)) {
    out.size = flag ? 0 : 1;
    return;
  }
  int64_t size = 0;
  if (!n.IsScalar() || !YAML::convert<int64_t>::decode(n, size) || size < 1) {
    throw ConfigError(m.ref(key), "reshard_after_forward is true, false or a group size N >= 1 that divides the "
                                  "shard dim (e.g. 2 on a dp 4 mesh), not '" + s + "'");
  }
  out.size = size;
}

nlohmann::json value_json(const models::TpPlan& plan) {
  nlohmann::json j;  // null, left out, when there are none
  for (const auto& r : plan) {
    j.push_back({{"module", r.pattern}, {"style", name_of(r.style)}, {"input", layout_name(r.input)},
                 {"output", layout_name(r.output)}, {"desired_input", layout_name(r.desired_input)}});
  }
  return j;
}

// As written: true (the whole shard group), false (kept gathered) or the group size.
nlohmann::json value_json(const parallel::ReshardAfterForward& r) {
  if (r.size <= 1) return r.size == 0;
  return r.size;
}

void read_value(YamlMap& root, const std::string& key, std::vector<TransformConfig>& out) {
  YAML::Node list = root.node(key);
  if (!list.IsSequence()) {
    throw ConfigError(root.ref(key), "expected a list of transforms, e.g. - fully_shard: {}");
  }
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(read_transform(list[i], key + "[" + std::to_string(i) + "]", root.context()));
  }
}

nlohmann::json value_json(const std::vector<TransformConfig>& transforms) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& t : transforms) j.push_back(to_json(t.options));
  return j;
}

std::vector<parallel::Transform> default_transforms() { return all_defaults(kAlternatives); }

std::vector<std::string> transform_names() {
  std::vector<std::string> out;
  for (const auto& t : default_transforms()) out.push_back(parallel::name_of(t));
  return out;
}

nlohmann::json to_json(const parallel::Transform& t) {
  nlohmann::json fields = nlohmann::json::object();
  std::visit(
      [&fields](auto c) {  // a copy: fields() hands out its members
        FieldWriter w{fields};
        c.fields(w);  // NOLINT: the walk only reads
      },
      t);
  return {{parallel::name_of(t), fields}};
}

std::vector<std::string> TransformConfig::mesh_dim_entries() const {
  return std::visit(
      [](const auto& o) -> std::vector<std::string> {
        if constexpr (HasMeshDim<std::decay_t<decltype(o)>>::value) {
          return o.mesh_dim;
        } else {
          return {};
        }
      },
      options);
}

std::vector<std::string> TransformConfig::mesh_dim() const { return flat_dims(mesh_dim_entries()); }

const SourceRef& TransformConfig::ref_of(const std::string& key) const {
  auto it = refs.find(key);
  return it == refs.end() ? ref : it->second;
}

const char* name_of(models::TpStyle v) { return lookup(kTpStyles, v); }

}  // namespace composer


// Reading the parallelize section: one reader per transform, each into its
// own typed options, in the order kTransformReaders lists them.
#include <cstdio>

#include "runner/config/parallelize_config.h"

namespace composer {
namespace {

const EnumName<DType> kDTypes[] = {{DType::kFloat32, "float32"},
                                   {DType::kFloat64, "float64"},
                                   {DType::kBFloat16, "bfloat16"},
                                   {DType::kFloat16, "float16"}};
const EnumName<ShardPlacement> kShardPlacements[] = {{ShardPlacement::kDim0, "dim0"},
                                                     {ShardPlacement::kOppositeTp, "opposite_tp"}};
const EnumName<AllGather> kAllGathers[] = {
    {AllGather::kPlain, "plain"}, {AllGather::kBfloat16, "bfloat16"}, {AllGather::kSplitBfloat16, "split_bfloat16"}};
const EnumName<Offload> kOffloads[] = {{Offload::kNone, "none"}, {Offload::kCpu, "cpu"}};
const EnumName<Rotate> kRotates[] = {{Rotate::kRing, "ring"}, {Rotate::kAllGather, "allgather"}};
const EnumName<Schedule> kSchedules[] = {{Schedule::kGpipe, "gpipe"},
                                         {Schedule::k1f1b, "1f1b"},
                                         {Schedule::kInterleaved1f1b, "interleaved_1f1b"},
                                         {Schedule::kLoopedBfs, "looped_bfs"},
                                         {Schedule::kInterleavedZeroBubble, "interleaved_zero_bubble"},
                                         {Schedule::kZbv, "zbv"}};

std::vector<std::string> read_dims(YamlMap& m, const std::string& key, std::vector<std::string> def) {
  if (!m.has(key)) return def;
  YAML::Node n = m.node(key);
  if (n.IsSequence()) return m.convert<std::vector<std::string>>(n, m.child_path(key));
  return {m.convert<std::string>(n, m.child_path(key))};
}

const EnumName<models::TpStyle> kTpStyles[] = {{models::TpStyle::kColwise, "colwise"},
                                               {models::TpStyle::kRowwise, "rowwise"},
                                               {models::TpStyle::kSequenceParallel, "sequence_parallel"},
                                               {models::TpStyle::kPrepareInput, "prepare_input"}};

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

models::TpPlan read_styles(YamlMap& parent) {
  models::TpPlan plan;
  if (!parent.has("styles")) return plan;
  YAML::Node list = parent.node("styles");
  const std::string path = parent.child_path("styles");
  if (!list.IsSequence()) {
    throw ConfigError(parent.ref("styles"), "expected a list like - {module: net1, style: colwise}");
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
    }
    r.input = read_layout(m, "input", r.input);
    r.output = read_layout(m, "output", r.output);
    r.desired_input = read_layout(m, "desired_input", r.desired_input);
    m.finish();
    plan.push_back(r);
  }
  return plan;
}

// fully_shard / replicate: per_rank patterns and the seed their values are drawn with.
template <class T>
void read_per_rank(YamlMap& m, T& t) {
  m.get("per_rank", t.per_rank);
  t.per_rank_ref = m.has("per_rank") ? m.ref("per_rank") : m.self_ref();
  m.get("per_rank_seed", t.per_rank_seed);
  if (t.per_rank_seed < -1) {
    throw ConfigError(m.ref("per_rank_seed"), "per_rank_seed must be >= 0 (rank i draws with seed + i), or -1 to keep "
                                              "the model's init");
  }
  if (t.per_rank_seed >= 0 && t.per_rank.empty()) {
    throw ConfigError(m.ref("per_rank_seed"), "per_rank_seed needs per_rank: the parameters drawn per rank (e.g. "
                                              "per_rank: [experts.*])");
  }
}

TransformOptions read_pipeline(YamlMap& m) {
  PipelineConfig t;
  t.mesh_dim = read_dims(m, "mesh_dim", t.mesh_dim);
  m.get_enum("schedule", t.schedule, kSchedules);
  m.get("microbatches", t.microbatches);
  require_non_negative(m.ref("microbatches"), static_cast<double>(t.microbatches), "microbatches");
  if (t.schedule == Schedule::kZbv) t.virtual_stages = 2;  // its V needs exactly two stages per rank
  m.get("virtual_stages", t.virtual_stages);
  require_positive(m.ref("virtual_stages"), static_cast<double>(t.virtual_stages), "virtual_stages");
  m.get("split_points", t.split_points);
  m.get("layers_per_stage", t.layers_per_stage);
  require_non_negative(m.ref("layers_per_stage"), static_cast<double>(t.layers_per_stage), "layers_per_stage");
  m.get("scale_grads", t.scale_grads);
  return t;
}

TransformOptions read_tensor_parallel(YamlMap& m) {
  TensorParallelConfig t;
  t.mesh_dim = read_dims(m, "mesh_dim", t.mesh_dim);
  m.get("plan", t.plan);
  m.get("sequence_parallel", t.sequence_parallel);
  m.get("loss_parallel", t.loss_parallel);
  t.styles = read_styles(m);
  if ((t.plan == "custom") != !t.styles.empty()) {
    throw ConfigError(m.self_ref(), "a custom plan lists its rules in `styles`, and `styles` needs plan: custom");
  }
  return t;
}

TransformOptions read_context_parallel(YamlMap& m) {
  ContextParallelConfig t;
  t.mesh_dim = read_dims(m, "mesh_dim", t.mesh_dim);
  m.get("load_balance", t.load_balance);
  m.get_enum("rotate", t.rotate, kRotates);
  return t;
}

TransformOptions read_activation_checkpointing(YamlMap& m) {
  ActivationCheckpointingConfig t;
  m.get("units", t.units);
  if (t.units.empty()) {
    throw ConfigError(m.self_ref(), "activation_checkpointing needs units: the modules to checkpoint, as FQN "
                                    "patterns (e.g. units: [layers.*])");
  }
  m.get("every", t.every);
  require_positive(m.ref("every"), static_cast<double>(t.every), "every");
  return t;
}

// true, false or a group size N >= 1 (whether N divides the shard group is the planner's check).
void read_reshard_after_forward(YamlMap& m, FullyShardConfig& t) {
  const std::string key = "reshard_after_forward";
  t.reshard_ref = m.has(key) ? m.ref(key) : m.self_ref();
  if (!m.has(key)) return;
  const YAML::Node n = m.node(key);
  const std::string s = n.IsScalar() ? n.Scalar() : "";
  bool flag = false;
  if (n.IsScalar() && YAML::convert<bool>::decode(n, flag)) {
    t.reshard_after_forward = flag ? 0 : 1;
    return;
  }
  int64_t size = 0;
  if (!n.IsScalar() || !YAML::convert<int64_t>::decode(n, size) || size < 1) {
    throw ConfigError(m.ref(key), "reshard_after_forward is true, false or a group size N >= 1 that divides the "
                                  "shard dim (e.g. 2 on a dp 4 mesh), not '" + s + "'");
  }
  t.reshard_after_forward = size;
}

TransformOptions read_fully_shard(YamlMap& m) {
  FullyShardConfig t;
  t.mesh_dim = read_dims(m, "mesh_dim", t.mesh_dim);
  m.get("units", t.units);
  read_reshard_after_forward(m, t);
  for (auto [key, out] : {std::pair{"param_dtype", &t.param_dtype}, std::pair{"reduce_dtype", &t.reduce_dtype}}) {
    if (!m.has(key)) continue;
    DType d = DType::kFloat32;
    read_dtype(m, key, d);
    *out = d;
  }
  m.get_enum("shard_placement", t.shard_placement, kShardPlacements);
  m.get_enum("all_gather", t.all_gather, kAllGathers);
  m.get_enum("offload", t.offload, kOffloads);
  m.get("prefetch", t.prefetch);
  read_per_rank(m, t);
  return t;
}

TransformOptions read_replicate(YamlMap& m) {
  ReplicateConfig t;
  t.mesh_dim = read_dims(m, "mesh_dim", t.mesh_dim);
  m.get("bucket_mb", t.bucket_mb);
  require_positive(m.ref("bucket_mb"), t.bucket_mb, "bucket_mb");
  read_per_rank(m, t);
  return t;
}

// Each transform's YAML key and reader, in the order they must be listed.
struct TransformReader {
  const char* key;
  TransformOptions (*read)(YamlMap&);
};
const TransformReader kTransformReaders[] = {
    {PipelineConfig::kKey, read_pipeline},
    {TensorParallelConfig::kKey, read_tensor_parallel},
    {ContextParallelConfig::kKey, read_context_parallel},
    {ActivationCheckpointingConfig::kKey, read_activation_checkpointing},
    {FullyShardConfig::kKey, read_fully_shard},
    {ReplicateConfig::kKey, read_replicate},
};

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
  for (const auto& r : kTransformReaders) {
    if (key != r.key) continue;
    YamlMap m(outer.node(key), path + "." + key, ctx);
    t.options = r.read(m);
    m.finish();
    return t;
  }
  const std::string hint = nearest(key, kinds);
  throw ConfigError(t.ref, "unknown transform '" + key + "'" + (hint.empty() ? "" : "; did you mean " + hint + "?") +
                               " valid transforms: " + YamlMap::join(kinds));
}

}  // namespace

std::vector<TransformConfig> read_parallelize(YamlMap& root) {
  std::vector<TransformConfig> out;
  if (!root.has("parallelize")) return out;
  YAML::Node list = root.node("parallelize");
  if (!list.IsSequence()) {
    throw ConfigError(root.ref("parallelize"), "expected a list of transforms, e.g. - fully_shard: {}");
  }
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(read_transform(list[i], "parallelize[" + std::to_string(i) + "]", root.context()));
  }
  return out;
}

std::vector<std::string> transform_names() {
  std::vector<std::string> out;
  for (const auto& r : kTransformReaders) out.push_back(r.key);
  return out;
}

const char* TransformConfig::name() const {
  return std::visit([](const auto& o) { return std::decay_t<decltype(o)>::kKey; }, options);
}

std::vector<std::string> TransformConfig::mesh_dim() const {
  return std::visit(
      [](const auto& o) -> std::vector<std::string> {
        if constexpr (std::is_same_v<std::decay_t<decltype(o)>, ActivationCheckpointingConfig>) {
          return {};
        } else {
          return flat_dims(o.mesh_dim);
        }
      },
      options);
}

std::vector<std::string> flat_dims(const std::vector<std::string>& entries) {
  std::vector<std::string> out;
  for (const auto& e : entries) {
    for (size_t at = 0; at <= e.size();) {
      const size_t end = std::min(e.find('+', at), e.size());
      out.push_back(e.substr(at, end - at));
      at = end + 1;
    }
  }
  return out;
}
void read_dtype(YamlMap& m, const std::string& key, DType& out) { m.get_enum(key, out, kDTypes); }

const char* name_of(DType v) { return lookup(kDTypes, v); }
const char* name_of(ShardPlacement v) { return lookup(kShardPlacements, v); }
const char* name_of(AllGather v) { return lookup(kAllGathers, v); }
const char* name_of(Offload v) { return lookup(kOffloads, v); }
const char* name_of(models::TpStyle v) { return lookup(kTpStyles, v); }

}  // namespace composer

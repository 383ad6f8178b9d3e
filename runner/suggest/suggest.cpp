#include "runner/suggest/suggest.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <set>
#include <tuple>
#include <sstream>

#include "models/module.h"
#include "parallelisms/pipeline/schedule.h"
#include "runner/config/config_document.h"
#include "runner/estimate/estimate.h"
#include "runner/suggest/search.h"
#include "runner/train/build.h"

namespace composer {
using namespace suggest_detail;
namespace {

// The config the user gave, its overrides applied and its parallelize left out (its mesh is replaced later).
YAML::Node base_document(const std::string& path, const std::vector<std::string>& overrides) {
  YAML::Node doc;
  try {
    doc = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    throw UserError("--config " + path + ": cannot read the file");
  } catch (const YAML::Exception& e) {
    throw UserError(path + ":" + std::to_string(e.mark.line + 1) + ": malformed YAML: " + e.msg);
  }
  ReadContext ctx{path, {}};
  check_suggest_overrides(overrides);
  for (const auto& o : overrides) apply_override(doc, o, ctx);
  doc.remove("parallelize");
  return doc;
}

std::string emit(const YAML::Node& n) {
  YAML::Emitter out;
  out << n;
  return std::string(out.c_str()) + "\n";
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

std::string quoted_list(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + ("'" + x + "'");
  return "[" + s + "]";
}

const char* const kRotateNames[] = {"ring", "allgather", "alltoall"};

}  // namespace

namespace suggest_detail {

namespace {

// The parameters' share of the facts: bytes, matrices per token (experts: top_k of them), the
// feed-forward width a token passes through, the routed layers.
void count_parameters(ModelFacts& f, models::Model& model, bool tied) {
  bool has_output = false;
  double embedding = 0, ffn = 0;
  std::set<std::string> routed_layers;
  f.per_layer.assign(static_cast<size_t>(std::max<int64_t>(0, f.layers)), {});
  bool seen_layers = false;
  for (const auto& [name, p] : nn::unique_named_parameters(model)) {
    const double bytes = static_cast<double>(p.numel()) * p.element_size();
    f.param_bytes += bytes;
    ++f.tensors;
    ModelFacts::Layer* layer = nullptr;  // the layers.N it belongs to
    if (name.rfind("layers.", 0) == 0) {
      const int64_t at = std::atoll(name.c_str() + 7);
      if (at >= 0 && at < f.layers) layer = &f.per_layer[static_cast<size_t>(at)];
      seen_layers = true;
    } else {
      (seen_layers ? f.last_bytes : f.first_bytes) += bytes;
    }
    const bool routed_stack = p.dim() == 3 && name.find(".experts.") != std::string::npos && f.experts > 0;
    if (layer) (routed_stack ? layer->expert_bytes : layer->bytes) += bytes;
    has_output = has_output || name == "output.weight";
    if (name == "tok_embeddings.weight") embedding = static_cast<double>(p.numel());
    const bool feed_forward = name.find("feed_forward.") != std::string::npos;
    if (p.dim() == 2 && name.find("embeddings") == std::string::npos) {
      f.matrix_params += static_cast<double>(p.numel());
      if (feed_forward && name.find("router") == std::string::npos) {
        ffn += static_cast<double>(p.numel()) / (3.0 * f.dim);
        if (layer) layer->ffn += static_cast<double>(p.numel()) / (3.0 * f.dim);
      }
    }
    if (routed_stack) {
      f.matrix_params += static_cast<double>(p.numel()) * f.top_k / f.experts;
      f.expert_matrix += static_cast<double>(p.numel()) * f.top_k / f.experts;
      f.expert_hidden = p.numel() / (f.experts * std::max<int64_t>(1, f.dim));
      ffn += static_cast<double>(p.numel()) * f.top_k / f.experts / (3.0 * f.dim);
      f.expert_bytes += bytes;
      routed_layers.insert(name.substr(0, name.find(".feed_forward")));
    }
  }
  f.moe_layers = static_cast<int64_t>(routed_layers.size());
  f.ffn_per_token = f.layers > 0 ? ffn / f.layers : 0.0;
  double split = 0;
  for (const auto& l : f.per_layer) split += l.ffn > 0 ? 1.0 : 0.0;
  f.split_ffn_share = f.per_layer.empty() ? (ffn > 0 ? 1.0 : 0.0) : split / static_cast<double>(f.per_layer.size());
  if (tied && !has_output) f.matrix_params += embedding;  // the table is also the output projection
}

// The top-level modules as units, a list's children as 'name.*'.
void units_of(ModelFacts& f, models::Model& model) {
  auto modules = nn::named_modules(model);
  for (const auto& [name, m] : modules) {
    if (name.empty() || name.find('.') != std::string::npos) continue;
    bool list = false;
    for (const auto& [other, n] : modules) list = list || other == name + ".0";
    f.units.push_back(list ? name + ".*" : name);
    f.has_layers = f.has_layers || (name == "layers" && list);
  }
}

}  // namespace

ModelFacts facts_of(const ExperimentConfig& c) {
  ModelFacts f;
  models::ModelPtr model;
  {
    nn::ShapeOnly shapes;
    model = build_model(c);
  }
  const auto& a = c.model.args;
  auto arg = [&](const char* name) -> int64_t {
    return a.values().count(name) && std::holds_alternative<int64_t>(a.values().at(name)) ? a.i(name) : 0;
  };
  f.layers = arg("n_layers");
  f.dim = arg("dim");
  f.heads = arg("n_heads");
  const int64_t kv_heads = arg("n_kv_heads") > 0 ? arg("n_kv_heads") : f.heads;
  f.head_dim = arg("head_dim") > 0 ? arg("head_dim") : (f.heads > 0 ? f.dim / f.heads : 0);
  f.kv_dim = f.heads > 0 ? f.head_dim * kv_heads : f.dim;
  f.attn_dim = f.heads > 0 ? f.head_dim * f.heads : f.dim;
  if (arg("kv_lora_rank") > 0) {  // latent attention: every head's key, and its value padded to the key's width on a ring
    const int64_t qk = arg("qk_nope_head_dim") + arg("qk_rope_head_dim");
    f.kv_dim = f.heads * qk;
    f.attn_dim = f.heads * (qk + arg("v_head_dim")) / 2;
    f.head_dim = qk;
    f.latent_attention = true;
  }
  f.attention = f.heads > 0;
  f.vocab = arg("vocab_size");
  f.seq = c.data.seq_len > 0 ? c.data.seq_len : std::max<int64_t>(1, arg("max_seq_len"));
  f.experts = arg("n_experts");
  f.top_k = std::max<int64_t>(1, arg("top_k"));
  const bool tied = a.values().count("weight_tying") && std::holds_alternative<bool>(a.values().at("weight_tying")) &&
                    a.b("weight_tying");
  count_parameters(f, *model, tied);
  units_of(f, *model);
  return f;
}

std::string Shape::name() const {
  static const char* dp_names[] = {"none", "replicate", "fsdp", "hsdp"};
  static const char* ac_names[] = {"none", "op", "full"};
  static const char* precision_names[] = {"", ".bf16", ".fp8"};
  std::string s = "tp" + std::to_string(tp) + (tp > 1 && tp_style < 2 ? "sp" : "") + (tp > 1 && tp_style == 0 ? "_lp" : "") +
                  ".cp" + std::to_string(cp);
  if (cp > 1 && rotate) s += std::string("_") + kRotateNames[rotate];
  if (ep > 1) s += ".ep" + std::to_string(ep) + (ep_borrows_dp ? "_on_dp" : "");
  s += ".pp" + std::to_string(pp);
  if (pp > 1) s += std::string("_") + parallel::name_of(schedule);
  s += "_m" + std::to_string(microbatches) + ".dp" + std::to_string(dp) + "_" + dp_names[static_cast<int>(dp_mode)];
  if (dp_mode == DpMode::kHsdp) s += std::to_string(dp / shard) + "x" + std::to_string(shard);
  if (keep) s += "_keep";
  s += std::string(".ac_") + ac_names[static_cast<int>(ac)];
  if (ac != Ac::kNone && ac_every > 1) s += "_every" + std::to_string(ac_every);
  return s + precision_names[static_cast<int>(precision)];
}

int64_t Shape::busiest_layers(int64_t layers) const {
  if (pp <= 1) return layers;
  const int64_t stages = pp * virtual_stages;
  return (layers + stages - 1) / stages * virtual_stages;
}

std::vector<std::pair<int64_t, int64_t>> stage_layers(const Shape& s, int64_t layers) {
  const int64_t stages = s.pp > 1 ? s.pp * s.virtual_stages : 1;
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  for (int64_t k = 0; k < stages; ++k) {
    const int64_t len = layers / stages + (k < layers % stages ? 1 : 0);
    out.push_back({at, at + len});
    at += len;
  }
  return out;
}

std::vector<std::string> pipeline_split_points(const Shape& s, int64_t layers) {
  if (s.pp <= 1 || layers % (s.pp * s.virtual_stages) == 0) return {};
  const auto ranges = stage_layers(s, layers);
  std::vector<std::string> points;
  for (size_t i = 0; i + 1 < ranges.size(); ++i) points.push_back("layers." + std::to_string(ranges[i].second));
  return points;
}

std::string Shape::family() const {
  std::string s = name();
  const size_t ac = s.find(".ac_");
  const size_t after = s.find('.', ac + 1);
  s = s.substr(0, ac) + (after == std::string::npos ? "" : s.substr(after));
  if (pp == 1) s.erase(s.find("_m"), s.find(".dp") - s.find("_m"));
  return s;
}

}  // namespace suggest_detail

namespace {

// The mesh and parallelize sections of `s`, and its train.microbatches.
std::string mesh_of(const Shape& s, const std::string& mesh_extra) {
  std::vector<std::string> names;
  std::vector<int64_t> sizes;
  auto dim = [&](const std::string& n, int64_t size) {
    if (size > 1) {
      names.push_back(n);
      sizes.push_back(size);
    }
  };
  dim("pp", s.pp);
  if (s.dp_mode == DpMode::kHsdp) {
    dim("dp_rep", s.dp / s.shard);
    dim("dp_shard", s.shard);
  } else {
    dim("dp", s.dp);
  }
  if (!s.ep_borrows_dp) dim("ep", s.ep);
  dim("cp", s.cp);
  dim("tp", s.tp);
  std::ostringstream o;
  o << "mesh: {shape: [";
  for (size_t i = 0; i < sizes.size(); ++i) o << (i ? ", " : "") << sizes[i];
  o << "], names: [";
  for (size_t i = 0; i < names.size(); ++i) o << (i ? ", " : "") << names[i];
  o << "]" << mesh_extra << "}\n";
  return o.str();
}

// The data-parallel transform of `s`: it spans dp and cp, whose ranks hold the same parameters.
std::string dp_transform(const Shape& s, const ModelFacts& f) {
  std::vector<std::string> span;
  if (s.dp > 1) span.push_back("dp");
  if (s.cp > 1) span.push_back("cp");
  std::string keep = s.keep ? ", reshard_after_forward: false" : "";
  if (s.precision == Precision::kBf16) keep += ", param_dtype: bfloat16, reduce_dtype: float32";
  if (s.dp_mode == DpMode::kReplicate) {
    std::string dims;
    for (const auto& d : span) dims += (dims.empty() ? "" : ", ") + d;
    return "replicate: {mesh_dim: [" + dims + "]}";
  }
  if (s.dp_mode == DpMode::kFullyShard) {
    std::string flat;
    for (const auto& d : span) flat += (flat.empty() ? "" : "+") + d;
    return "fully_shard: {mesh_dim: " + flat + ", units: " + quoted_list(f.units) + keep + "}";
  }
  if (s.dp_mode == DpMode::kHsdp) {
    return "fully_shard: {mesh_dim: [dp_rep, dp_shard], units: " + quoted_list(f.units) + keep + "}";
  }
  return "";
}

std::string sections(const Shape& s, const ModelFacts& f, const std::string& mesh_extra, bool given_microbatches) {
  std::ostringstream o;
  o << mesh_of(s, mesh_extra) << "parallelize:";
  std::vector<std::string> t;
  if (s.pp > 1) {
    const std::vector<std::string> splits = pipeline_split_points(s, f.layers);
    t.push_back("pipeline: {mesh_dim: pp, schedule: " + std::string(parallel::name_of(s.schedule)) +
                (s.virtual_stages > 1 ? ", virtual_stages: " + std::to_string(s.virtual_stages) : "") +
                (given_microbatches ? "" : ", microbatches: " + std::to_string(s.microbatches)) +
                (splits.empty() ? "" : ", split_points: " + quoted_list(splits)) + "}");
  }
  if (s.tp > 1) {
    t.push_back(std::string("tensor_parallel: {mesh_dim: tp") + (s.tp_style < 2 ? ", sequence_parallel: true" : "") +
                (s.tp_style < 1 ? ", loss_parallel: true" : "") + "}");
  }
  if (s.cp > 1) {
    t.push_back("context_parallel: {mesh_dim: cp" +
                (s.rotate ? std::string(", rotate: ") + kRotateNames[s.rotate] : std::string()) + "}");
  }
  if (s.ep > 1) {
    const char* dim = !s.ep_borrows_dp ? "ep" : s.dp_mode == DpMode::kHsdp ? "dp_shard" : "dp";
    t.push_back(std::string("expert_parallel: {mesh_dim: ") + dim + "}");
  }
  if (s.ac != Ac::kNone) {
    t.push_back("activation_checkpointing: {units: ['layers.*']" + std::string(s.ac == Ac::kOp ? ", mode: op" : "") +
                (s.ac_every > 1 ? ", every: " + std::to_string(s.ac_every) : "") + "}");
  }
  if (const std::string d = dp_transform(s, f); !d.empty()) t.push_back(d);
  if (t.empty()) o << " []";
  for (const auto& x : t) o << "\n  - " << x;
  o << "\n";
  return o.str();
}

// The data-parallel modes of dp x cp ranks (the shard dim of HSDP within a node): (mode, HSDP's shard, keep).
std::vector<std::tuple<DpMode, int64_t, bool>> dp_modes(const World& w, int64_t tp, int64_t cp, int64_t dp) {
  std::vector<std::tuple<DpMode, int64_t, bool>> dps;
  if (dp * cp == 1) dps.push_back({DpMode::kNone, 1, false});
  if (dp * cp > 1) {
    dps.push_back({DpMode::kReplicate, 1, false});
    dps.push_back({DpMode::kFullyShard, 1, false});
    dps.push_back({DpMode::kFullyShard, 1, true});
  }
  const int64_t shard = w.ranks_per_node / (tp * cp);
  if (cp == 1 && shard > 1 && shard < dp && dp % shard == 0) {
    dps.push_back({DpMode::kHsdp, shard, false});
    dps.push_back({DpMode::kHsdp, shard, true});
  }
  return dps;
}

// expert_parallel's choices for a plan with `rest` ranks left for dp: none, its own dim of each size
// that divides the experts, or borrowing dp (or HSDP's shard dim) under fully_shard.
std::vector<std::tuple<int64_t, int64_t, bool>> ep_choices(const ModelFacts& f, int64_t rest) {
  std::vector<std::tuple<int64_t, int64_t, bool>> out{{1, rest, false}};  // (ep, dp, borrows)
  if (f.moe_layers == 0) return out;
  for (int64_t ep : divisors(rest)) {
    if (ep == 1 || f.experts % ep) continue;
    out.push_back({ep, rest / ep, false});
    if (ep == rest) out.push_back({ep, rest, true});
  }
  return out;
}

// Activation checkpointing's choices: none, op, full, and full on every other layer.
std::vector<std::pair<Ac, int64_t>> ac_choices(const ModelFacts& f) {
  if (!f.has_layers) return {{Ac::kNone, 1}};
  std::vector<std::pair<Ac, int64_t>> out{{Ac::kNone, 1}, {Ac::kOp, 1}, {Ac::kFull, 1}};
  if (f.layers > 2) out.push_back({Ac::kFull, 2});
  return out;
}

// The precisions worth searching: the config's own, and on a device with bfloat16 and float8 matmuls,
// fully_shard's bfloat16 and train.fp8 (tensorwise).
std::vector<Precision> precisions(const World& w, const ExperimentConfig& c) {
  if (!w.cuda || c.train.dtype != DType::kFloat32 || c.train.fp8) return {Precision::kAsGiven};
  return {Precision::kAsGiven, Precision::kBf16, Precision::kFp8Tensorwise};
}

struct Axes {
  int64_t global_batch = 1;  // a plan whose data-parallel ranks and microbatches do not split it is not one
  std::vector<std::pair<parallel::ScheduleKind, int64_t>> schedules;
  std::vector<std::pair<Ac, int64_t>> acs;
  std::vector<Precision> precisions;
  std::vector<int> rotates;
};

// Every variant of one (tp, cp, pp, ep, dp) layout into `out`.
void variants(std::vector<Shape>& out, Shape base, const World& w, const Axes& axes, int64_t given) {
  for (const auto& [mode, sh, keep] : dp_modes(w, base.tp, base.cp, base.dp)) {
    if (base.ep_borrows_dp && mode != DpMode::kFullyShard && mode != DpMode::kHsdp) continue;
    for (const auto& [kind, v] : axes.schedules) {
      for (int64_t mb : {int64_t{1}, int64_t{2}, int64_t{4}}) {
        if (given > 0 && mb > 1) continue;
        for (const auto& [ac, every] : axes.acs) {
          for (Precision p : axes.precisions) {
            if (p == Precision::kBf16 && mode != DpMode::kFullyShard && mode != DpMode::kHsdp) continue;
            for (int rotate : axes.rotates) {
              Shape s = base;
              s.dp_mode = mode, s.shard = sh, s.keep = keep, s.schedule = kind, s.virtual_stages = v;
              s.microbatches = given > 0 ? given
                               : base.pp > 1 ? mb * base.pp * (kind == parallel::ScheduleKind::kZbv ? 2 : 1)
                                             : mb;
              s.ac = ac, s.ac_every = every, s.precision = p, s.rotate = rotate;
              if (s.ep_borrows_dp && mode == DpMode::kHsdp && s.ep != s.shard) continue;
              if (axes.global_batch % (s.batch_split() * s.microbatches) != 0) continue;  // the planner's first refusal
              // train.fp8's refusals (plan_fp8.cpp): deferred weight gradients, scales over other samples.
              if (p == Precision::kFp8Tensorwise &&
                  (parallel::zero_bubble(kind) || (s.batch_split() > 1 && s.microbatches > 1))) {
                continue;
              }
              out.push_back(s);
            }
          }
        }
      }
    }
  }
}

// Every shape for `world`: tp within a node, cp 1, 2 or 4 (each rotation), pp up to the layers, expert_parallel
// for routed experts, the rest dp; microbatches as the config gives them (`given` > 0), else searched.
std::vector<Shape> shapes_of(const World& w, const ModelFacts& f, const ExperimentConfig& c, int64_t given) {
  std::vector<Shape> out;
  const int64_t n = w.size();
  Axes axes;
  axes.acs = ac_choices(f);
  axes.global_batch = c.train.global_batch;
  axes.precisions = precisions(w, c);
  for (int64_t tp : divisors(n)) {
    if (tp > w.ranks_per_node) continue;
    for (int64_t cp : divisors(n / tp)) {
      if (cp > 4 || (cp > 1 && !f.has_layers)) continue;
      axes.rotates = cp > 1 ? std::vector<int>{0, 1, 2} : std::vector<int>{0};
      for (int64_t pp : divisors(n / (tp * cp))) {
        if (pp > 1 && (!f.has_layers || pp > f.layers)) continue;
        // At least a layer a stage; where they do not split evenly, the suggested plan gives split_points.
        axes.schedules.clear();
        for (const auto& [kind, v] : {std::pair{parallel::ScheduleKind::k1f1b, int64_t{1}},
                                      {parallel::ScheduleKind::kInterleaved1f1b, int64_t{2}},
                                      {parallel::ScheduleKind::kZbv, int64_t{2}}}) {
          if (pp == 1 && v > 1) continue;
          if (pp * v > f.layers) continue;
          axes.schedules.push_back({kind, v});
        }
        for (const auto& [ep, dp, borrows] : ep_choices(f, n / (tp * cp * pp))) {
          Shape base;
          base.tp = tp, base.cp = cp, base.pp = pp, base.dp = dp, base.ep = ep, base.ep_borrows_dp = borrows;
          variants(out, base, w, axes, given);
        }
      }
    }
  }
  return out;
}

double flops_of(const ModelFacts& f, const ExperimentConfig& c) {
  const double per_token = 6 * f.matrix_params + (f.attention ? 12.0 * f.layers * f.attn_dim * f.seq : 0.0);
  return per_token * f.seq * static_cast<double>(c.train.global_batch);
}

}  // namespace

void check_suggest_overrides(const std::vector<std::string>& overrides) {
  for (const auto& o : overrides) {
    if (o.rfind("mesh", 0) == 0 || o.rfind("parallelize", 0) == 0) {
      throw UserError("--set " + o + ": composer suggest chooses the mesh and parallelize; set the world with "
                      "--ranks-per-node, --nodes and --device-memory instead");
    }
  }
}

namespace {

// The mesh keys a suggestion keeps from the config (device, backend, timeout_s) and the memory it plans for.
std::string mesh_extra_of(const YAML::Node& base, const World& w) {
  YAML::Node mesh = base["mesh"];
  std::string extra;
  for (const char* key : {"device", "backend", "timeout_s"}) {
    if (mesh && mesh.IsMap() && mesh[key]) extra += std::string(", ") + key + ": " + mesh[key].as<std::string>();
  }
  return extra + ", memory_per_rank_mb: " + std::to_string(w.memory_per_rank / (1024 * 1024));
}

// The config's sections besides mesh and parallelize for `s`: gradient accumulation and float8 where searched.
std::string rest_of(const Shape& s, const YAML::Node& doc, const std::string& base_text, int64_t given) {
  const bool accumulate = !given && s.pp == 1 && s.microbatches > 1;
  const bool fp8 = s.precision == Precision::kFp8Tensorwise;
  if (!accumulate && !fp8) return base_text;
  YAML::Node d = YAML::Clone(doc);
  if (accumulate) d["train"]["microbatches"] = s.microbatches;
  if (fp8) d["train"]["fp8"]["recipe"] = "tensorwise";
  return emit(d);
}

}  // namespace

namespace suggest_detail {

std::string config_of(const Shape& s, const ModelFacts& f, const YAML::Node& doc, const std::string& doc_text,
                      int64_t given, const std::string& mesh_extra) {
  return rest_of(s, doc, doc_text, given) + sections(s, f, mesh_extra, given > 0);
}

}  // namespace suggest_detail

namespace {

// A shape, priced.
struct Priced {
  Shape shape;
  StepTerms terms;
};

// Every shape of the world (tensor parallelism with sequence and loss parallelism, sequence
// parallelism alone, or neither), priced from the model's facts, in cost order. No planner yet:
// pricing is closed-form, so the planner and the dry runs see only the cheapest.
std::vector<Priced> priced_shapes(const ModelFacts& f, const ExperimentConfig& one, int64_t given, World& w,
                                  Suggestion& out) {
  std::vector<Priced> priced;
  for (Shape s : shapes_of(w, f, one, given)) {
    // sequence parallelism has no plan for routed blocks (the planner refuses it): plain tp only there
    for (s.tp_style = s.tp > 1 && f.moe_layers > 0 ? 2 : 0; s.tp_style < (s.tp > 1 ? 3 : 1); ++s.tp_style) {
      ++out.candidates;
      priced.push_back({s, price(s, f, one, w)});
    }
  }
  std::stable_sort(priced.begin(), priced.end(),
                   [](const Priced& a, const Priced& b) { return a.terms.step_s() < b.terms.step_s(); });
  return priced;
}

// What the walk in cost order needs besides the priced shapes.
struct Walk {
  const std::string& path;
  const YAML::Node& doc;
  const std::string& mesh_extra;
  const ModelFacts& f;
  const ExperimentConfig& one;  // the config on one rank, for the memory floor
  int64_t given;
  int top, max_estimates;
  double max_seconds;
  const DryRunProgress& progress;
};

// Whether `s` certainly needs at least the memory of `over`, a plan already run dry over it: the same plan
// but for what only buys memory, where `s` buys less (activation checkpointing weaker or on fewer layers,
// fully_shard keeping its parameters gathered where `over` reshards, fewer and so larger microbatches).
bool needs_more_than(const Shape& s, const Shape& over) {
  if (std::tie(s.tp, s.cp, s.pp, s.dp, s.shard, s.dp_mode, s.schedule, s.virtual_stages, s.tp_style, s.ep, s.ep_borrows_dp,
               s.rotate, s.precision) != std::tie(over.tp, over.cp, over.pp, over.dp, over.shard, over.dp_mode, over.schedule,
                                                  over.virtual_stages, over.tp_style, over.ep, over.ep_borrows_dp,
                                                  over.rotate, over.precision)) {
    return false;
  }
  if (s.microbatches > over.microbatches || (over.keep && !s.keep)) return false;
  if (s.ac == Ac::kNone) return true;
  if (s.ac == over.ac) return s.ac_every >= over.ac_every;
  return s.ac == Ac::kOp && over.ac == Ac::kFull && over.ac_every == 1;  // op keeps what full keeps and more
}

// The walk over the priced shapes: each written as a config and put to the planner, and each accepted
// one run dry (the per-rank memory estimate) until `top` fit or `max_estimates` ran: into out.fitting and
// out.unfit; the rest, passed over, refused or priced only, into out.others.
class FitWalk {
 public:
  FitWalk(const std::vector<Priced>& priced, const Walk& k, const World& w, Suggestion& out)
      : priced_(priced), k_(k), w_(w), out_(out), limit_(w.usable()), base_text_(emit(k.doc)),
        done_(priced.size(), false), t0_(std::chrono::steady_clock::now()) {}

  // Cost order first. Where nothing fits by a third of the time given, the memory is what binds: of the
  // rest (the cheapest kMemoryFirst), those whose memory floor is under kLowFloor of the memory in cost
  // order, then the others, the least floor first, until --top fit or the time given passes (twice it
  // while none fits). On the examples' plans that fit a floor is 29-70% of the peak.
  void run() {
    size_t i = 0;
    while (i < priced_.size() && visit(i, out_.fitting.empty() ? k_.max_seconds / 3 : k_.max_seconds)) ++i;
    if (out_.fitting.empty() && i < priced_.size() && out_.estimated < k_.max_estimates &&
        elapsed() > k_.max_seconds / 3) {
      memory_first(i);
    }
    for (size_t j = 0; j < priced_.size(); ++j) {
      if (!done_[j]) out_.others.push_back({priced_[j].shape.name(), "", priced_[j].shape.family(), priced_[j].terms});
    }
    std::stable_sort(out_.others.begin(), out_.others.end(), by_cost);
  }

 private:
  static constexpr size_t kMemoryFirst = 50000;
  static constexpr double kLowFloor = 0.4;
  static bool by_cost(const Candidate& a, const Candidate& b) { return a.step_s() < b.step_s(); }
  double elapsed() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }

  void memory_first(size_t from) {
    std::vector<std::pair<double, size_t>> by_floor;
    for (size_t j = from; j < priced_.size() && by_floor.size() < kMemoryFirst; ++j) {
      by_floor.push_back({memory_floor(priced_[j].shape, k_.f, k_.one, w_), j});
    }
    auto rest = std::stable_partition(by_floor.begin(), by_floor.end(),
                                      [&](const auto& x) { return x.first <= kLowFloor * limit_; });
    std::stable_sort(rest, by_floor.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [floor, j] : by_floor) {
      if (!visit(j, out_.fitting.empty() ? 2 * k_.max_seconds : k_.max_seconds, floor)) break;
    }
    out_.memory_first = true;
    std::stable_sort(out_.fitting.begin(), out_.fitting.end(), by_cost);
    std::stable_sort(out_.unfit.begin(), out_.unfit.end(), by_cost);
  }

  // Whether `s` need not be put to the planner (a cheaper member of its family fits, its floor is over
  // the memory, or it needs more than a plan run dry over it), counted where it is.
  bool passed_over(const Shape& s, const Candidate& cand) {
    if (fitted_.count(cand.family)) return true;
    if (cand.floor > limit_) {
      ++out_.floored;
      return true;
    }
    if (std::any_of(over_.begin(), over_.end(), [&](const Shape& o) { return needs_more_than(s, o); })) {
      ++out_.dominated;
      return true;
    }
    return false;
  }

  // One shape: passed over, refused, or run dry. False: the walk stops before it (enough fit, the dry runs
  // or the time given are spent). `floor`: its memory floor where already known (< 0: not yet).
  bool visit(size_t i, double seconds, double floor = -1) {
    if (static_cast<int>(out_.fitting.size()) >= k_.top || out_.estimated >= k_.max_estimates) return false;
    if (elapsed() > seconds) {
      out_.out_of_time = !out_.fitting.empty();  // a plan fits; the next dry runs would pass the time given
      return false;
    }
    if (out_.planned >= 40 * k_.max_estimates) return false;  // the planner refuses nearly everything: enough tried
    done_[i] = true;
    const Shape& s = priced_[i].shape;
    Candidate cand{s.name(), "", s.family(), priced_[i].terms};
    cand.floor = floor >= 0 ? floor : memory_floor(s, k_.f, k_.one, w_);
    if (passed_over(s, cand)) {
      out_.others.push_back(std::move(cand));
      return true;
    }
    cand.yaml = config_of(s, k_.f, k_.doc, base_text_, k_.given, k_.mesh_extra);
    ++out_.planned;
    try {
      const ExperimentConfig c = parse_config(cand.yaml, k_.path);
      const Plan plan = make_plan(c, w_.size());
      ++out_.estimated;
      const auto start = std::chrono::steady_clock::now();
      const auto stop_above = static_cast<int64_t>(limit_);
      cand.peak = estimate_peak(c, plan, w_.ranks_per_node, stop_above);
      cand.stopped = cand.peak == stop_above + 1;
      cand.fits = static_cast<double>(cand.peak) <= limit_;
      if (k_.progress) k_.progress(cand, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    } catch (const UserError& e) {
      ++out_.refused;
      if (out_.first_refusal.empty()) out_.first_refusal = cand.name + ": " + e.what();
      cand.refusal = e.what();
      cand.yaml.clear();
      out_.others.push_back(std::move(cand));
      return true;
    }
    if (cand.fits) fitted_.insert(cand.family);
    else over_.push_back(s);
    (cand.fits ? out_.fitting : out_.unfit).push_back(std::move(cand));
    return true;
  }

  const std::vector<Priced>& priced_;
  const Walk& k_;
  const World& w_;
  Suggestion& out_;
  const double limit_;
  const std::string base_text_;
  std::set<std::string> fitted_;  // families with a plan that fits: their costlier members buy memory not needed
  std::vector<Shape> over_;       // plans run dry over the memory
  std::vector<bool> done_;        // shapes visited
  const std::chrono::steady_clock::time_point t0_;
};

}  // namespace

Suggestion suggest(const std::string& path, const std::vector<std::string>& overrides, World& w, int top,
                   int max_estimates, double max_seconds, const DryRunProgress& progress) {
  const YAML::Node base = base_document(path, overrides);
  const std::string mesh_extra = mesh_extra_of(base, w);
  YAML::Node doc = YAML::Clone(base);
  doc.remove("mesh");
  const ExperimentConfig one = parse_config(emit(doc) + "mesh: {shape: [], names: []}\nparallelize: []\n", path);
  const ModelFacts f = facts_of(one);
  const int64_t given = doc["train"] && doc["train"]["microbatches"] ? doc["train"]["microbatches"].as<int64_t>() : 0;
  Suggestion out;
  out.flops_per_step = flops_of(f, one);
  const std::vector<Priced> priced = priced_shapes(f, one, given, w, out);
  const Walk walk{path, doc, mesh_extra, f, one, given, top, max_estimates, max_seconds, progress};
  FitWalk(priced, walk, w, out).run();
  if (w.rates.dirty && w.rates.measure) save_rates(w.rates);
  return out;
}

std::vector<std::pair<std::string, double>> StepTerms::named_ms() const {
  const double raw = raw_comm_s(), fit = raw > 0 ? comm_s() / raw : 1.0;  // communication's refit, blended
  return {{"matmul", matmul_s * compute_fit * 1e3},
          {"elementwise", elementwise_s * compute_fit * 1e3},
          {"kernel overhead", kernels_s * compute_fit * 1e3},
          {"optimizer", optimizer_s * compute_fit * 1e3},
          {"collectives' core time", comm_core_s * compute_fit * 1e3},
          {"pipeline bubble", bubble_s * 1e3},
          {"tensor-parallel communication", tp_s * fit * 1e3},
          {"context-parallel communication", cp_s * fit * 1e3},
          {"data-parallel communication", (dp_s - hidden_s) * fit * 1e3},
          {"pipeline sends", pp_s * fit * 1e3},
          {"expert dispatch", ep_s * fit * 1e3},
          {"step statistics", stats_s * fit * 1e3}};
}

std::string explain_choice(const Candidate& best, const Candidate& next) {
  const auto a = best.terms.named_ms(), b = next.terms.named_ms();
  std::vector<std::pair<double, std::string>> diffs;
  for (size_t i = 0; i < a.size(); ++i) diffs.push_back({b[i].second - a[i].second, a[i].first});
  std::sort(diffs.begin(), diffs.end(), [](const auto& x, const auto& y) { return std::abs(x.first) > std::abs(y.first); });
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << best.name << " is " << (next.step_s() - best.step_s()) * 1e3 << " ms a step cheaper than " << next.name << ": ";
  int said = 0;
  for (const auto& [d, name] : diffs) {
    if (said == 3 || std::abs(d) < 0.05) break;
    o << (said++ ? ", " : "") << name << " " << (d >= 0 ? "-" : "+") << std::abs(d) << " ms";
  }
  if (!said) o << "no term differs by 0.1 ms";
  return o.str();
}

nlohmann::json candidate_json(const Candidate& c) {
  nlohmann::json terms;
  for (const auto& [name, ms] : c.terms.named_ms()) terms[name] = ms;
  return {{"name", c.name},         {"step_ms", c.step_s() * 1e3}, {"compute_ms", c.terms.compute_s() * 1e3},
          {"comm_ms", c.terms.comm_s() * 1e3}, {"comm_latency_ms", c.terms.comm_latency_s * c.terms.latency_fit * 1e3},
          {"bubble", c.terms.bubble}, {"recompute_ms", c.terms.recompute_s * 1e3},
          {"matmul_tflops", c.terms.rate / 1e12}, {"terms_ms", terms}, {"peak_bytes", c.peak}, {"dry_run_stopped_over_memory", c.stopped},
          {"memory_floor_bytes", c.floor}, {"fits", c.fits},
          {"refused", c.refusal}};
}

nlohmann::json suggestion_json(const Suggestion& s, const World& w) {
  nlohmann::json j = {{"ranks_per_node", w.ranks_per_node}, {"nodes", w.nodes},
                      {"memory_per_rank", w.memory_per_rank}, {"rates", to_json(w.rates)},
                      {"rates_source", w.rates.source},   {"candidates", s.candidates},
                      {"refused", s.refused},             {"estimated", s.estimated}, {"planned", s.planned},
                      {"over_memory_by_floor", s.floored}, {"over_memory_as_another", s.dominated}, {"memory_first", s.memory_first},
                      {"flops_per_step", s.flops_per_step}};
  j["rates"].erase("matmul_by_shape");
  j["fitting"] = nlohmann::json::array();
  j["over_memory"] = nlohmann::json::array();
  j["not_run_dry"] = nlohmann::json::array();
  for (const auto& c : s.fitting) j["fitting"].push_back(candidate_json(c));
  for (const auto& c : s.unfit) j["over_memory"].push_back(candidate_json(c));
  for (const auto& c : s.others) j["not_run_dry"].push_back(candidate_json(c));
  return j;
}

std::string describe_line(const Candidate& c) {
  std::ostringstream l;
  l.precision(3);
  l << c.name << ": step " << c.step_s() * 1e3 << " ms (compute " << c.terms.compute_s() * 1e3 << " ms at "
    << c.terms.rate / 1e12 << " TFLOP/s, communication " << c.terms.comm_s() * 1e3 << " ms, bubble "
    << c.terms.bubble << "), peak " << format_bytes(c.peak);
  return l.str();
}

std::string suggested_yaml(const Suggestion& s, const World& w, size_t pick) {
  TORCH_CHECK(pick < s.fitting.size(), "no plan fits");
  const Candidate& best = s.fitting[pick];
  std::ostringstream o;
  o.precision(3);
  const MachineRates& r = w.rates;
  o << "# composer suggest for " << w.nodes << " node(s) x " << w.ranks_per_node << " ranks, "
    << format_bytes(w.memory_per_rank) << " per rank (keeping " << w.margin * 100 << "% free); model FLOPs "
    << s.flops_per_step << " per step.\n"
    << "# " << r.describe() << ".\n"
    << "# " << s.candidates << " plans priced; in cost order " << s.floored
    << " passed over (their memory floor is over the limit), " << s.dominated
    << " as certainly over as a plan run dry, " << s.planned << " put to the planner, " << s.refused
    << " refused, " << s.estimated << " run dry, " << s.fitting.size() << " fit"
    << (s.out_of_time ? " (the dry runs stopped at --max-seconds)" : "")
    << (s.memory_first ? " (none fit in cost order within a third of --max-seconds: the rest were run dry least "
                         "memory floor first, so a cheaper plan that fits may be left untried)"
                       : "")
    << ".\n"
    << "# " << (pick ? "runner-up " + std::to_string(pick + 1) + ": " : "chosen, the cheapest that fits: ")
    << describe_line(best) << "\n";
  if (pick + 1 < s.fitting.size()) o << "# why: " << explain_choice(best, s.fitting[pick + 1]) << "\n";
  for (size_t i = 0; i < s.fitting.size(); ++i) {
    if (i != pick) o << "# " << (i ? "runner-up " + std::to_string(i + 1) : "the best") << ": " << describe_line(s.fitting[i]) << "\n";
  }
  for (const auto& c : s.unfit) o << "# cheaper but over the memory: " << describe_line(c) << "\n";
  o << best.yaml;
  return o.str();
}

}  // namespace composer

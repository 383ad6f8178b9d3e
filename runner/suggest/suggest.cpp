#include "runner/suggest/suggest.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <tuple>
#include <sstream>

#include "models/module.h"
#include "parallelisms/pipeline/schedule.h"
#include "runner/config/config_document.h"
#include "runner/estimate/estimate.h"
#include "runner/train/build.h"

namespace composer {
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

// What the search needs to know of the model: its matrix parameters, shape
// arguments and the modules that make units.
struct ModelFacts {
  double matrix_params = 0;     // per token: every 2-D weight but embedding tables (experts: top_k of them)
  double param_bytes = 0;       // every parameter
  int64_t layers = 0, dim = 0, kv_dim = 0, seq = 1;  // seq: tokens per sample (1: a feature model)
  // The widths of all heads' queries (and keys) and of their values, halved summed: dim for llama.
  int64_t attn_dim = 0;
  bool attention = false;
  std::vector<std::string> units;  // top-level modules, a list's children as 'name.*'
  bool has_layers = false;
};

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
  const int64_t heads = arg("n_heads"), kv_heads = arg("n_kv_heads") > 0 ? arg("n_kv_heads") : heads;
  const int64_t head_dim = arg("head_dim") > 0 ? arg("head_dim") : (heads > 0 ? f.dim / heads : 0);
  f.kv_dim = heads > 0 ? head_dim * kv_heads : f.dim;
  f.attn_dim = heads > 0 ? head_dim * heads : f.dim;
  if (arg("kv_lora_rank") > 0) {  // latent attention: every head's key, and its value padded to the key's width on a ring
    const int64_t qk = arg("qk_nope_head_dim") + arg("qk_rope_head_dim");
    f.kv_dim = heads * qk;
    f.attn_dim = heads * (qk + arg("v_head_dim")) / 2;
  }
  f.attention = heads > 0;
  f.seq = c.data.seq_len > 0 ? c.data.seq_len : std::max<int64_t>(1, arg("max_seq_len"));
  const int64_t experts = arg("n_experts"), top_k = std::max<int64_t>(1, arg("top_k"));
  bool has_output = false;
  double embedding = 0;
  for (const auto& [name, p] : nn::unique_named_parameters(*model)) {
    f.param_bytes += static_cast<double>(p.numel()) * p.element_size();
    has_output = has_output || name == "output.weight";
    if (name == "tok_embeddings.weight") embedding = static_cast<double>(p.numel());
    if (p.dim() == 2 && name.find("embeddings") == std::string::npos) f.matrix_params += static_cast<double>(p.numel());
    if (p.dim() == 3 && name.find(".experts.") != std::string::npos && experts > 0) {
      f.matrix_params += static_cast<double>(p.numel()) * top_k / experts;
    }
  }
  const bool tied = a.values().count("weight_tying") && std::holds_alternative<bool>(a.values().at("weight_tying")) &&
                    a.b("weight_tying");
  if (tied && !has_output) f.matrix_params += embedding;  // the table is also the output projection
  auto modules = nn::named_modules(*model);
  for (const auto& [name, m] : modules) {
    if (name.empty() || name.find('.') != std::string::npos) continue;
    bool list = false;
    for (const auto& [other, n] : modules) list = list || other == name + ".0";
    f.units.push_back(list ? name + ".*" : name);
    f.has_layers = f.has_layers || (name == "layers" && list);
  }
  return f;
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

enum class DpMode { kNone, kReplicate, kFullyShard, kHsdp };
enum class Ac { kNone, kOp, kFull };

struct Shape {
  int64_t tp = 1, cp = 1, pp = 1, dp = 1, shard = 1;  // shard: HSDP's shard dim (within a node)
  DpMode dp_mode = DpMode::kNone;
  parallel::ScheduleKind schedule = parallel::ScheduleKind::k1f1b;
  int64_t virtual_stages = 1, microbatches = 1;
  Ac ac = Ac::kNone;
  bool keep = false;  // fully_shard and HSDP: reshard_after_forward false (no second all-gather in backward)
  int tp_style = 0;   // 0: sequence and loss parallel, 1: sequence parallel, 2: plain

  std::string name() const {
    static const char* dp_names[] = {"none", "replicate", "fsdp", "hsdp"};
    static const char* ac_names[] = {"none", "op", "full"};
    std::string s = "tp" + std::to_string(tp) + (tp > 1 && tp_style < 2 ? "sp" : "") + ".cp" + std::to_string(cp) +
                    ".pp" + std::to_string(pp);
    if (pp > 1) s += std::string("_") + parallel::name_of(schedule);
    s += "_m" + std::to_string(microbatches) + ".dp" + std::to_string(dp) + "_" + dp_names[static_cast<int>(dp_mode)];
    if (dp_mode == DpMode::kHsdp) s += std::to_string(dp / shard) + "x" + std::to_string(shard);
    if (keep) s += "_keep";
    return s + ".ac_" + ac_names[static_cast<int>(ac)];
  }
  // The plans that differ only in what buys memory at some cost: activation
  // checkpointing, and gradient accumulation without a pipeline.
  std::string family() const {
    std::string s = name();
    s = s.substr(0, s.find(".ac_"));
    if (pp == 1) s.erase(s.find("_m"), s.find(".dp") - s.find("_m"));
    return s;
  }
};

// The mesh and parallelize sections of `s`, and its train.microbatches.
std::string sections(const Shape& s, const ModelFacts& f, const std::string& mesh_extra, bool given_microbatches) {
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
  dim("cp", s.cp);
  dim("tp", s.tp);
  std::ostringstream o;
  o << "mesh: {shape: [";
  for (size_t i = 0; i < sizes.size(); ++i) o << (i ? ", " : "") << sizes[i];
  o << "], names: [";
  for (size_t i = 0; i < names.size(); ++i) o << (i ? ", " : "") << names[i];
  o << "]" << mesh_extra << "}\nparallelize:";
  std::vector<std::string> t;
  if (s.pp > 1) {
    t.push_back("pipeline: {mesh_dim: pp, schedule: " + std::string(parallel::name_of(s.schedule)) +
                (s.virtual_stages > 1 ? ", virtual_stages: " + std::to_string(s.virtual_stages) : "") +
                (given_microbatches ? "" : ", microbatches: " + std::to_string(s.microbatches)) + "}");
  }
  if (s.tp > 1) {
    t.push_back(std::string("tensor_parallel: {mesh_dim: tp") + (s.tp_style < 2 ? ", sequence_parallel: true" : "") +
                (s.tp_style < 1 ? ", loss_parallel: true" : "") + "}");
  }
  if (s.cp > 1) t.push_back("context_parallel: {mesh_dim: cp}");
  if (s.ac != Ac::kNone) {
    t.push_back("activation_checkpointing: {units: ['layers.*']" + std::string(s.ac == Ac::kOp ? ", mode: op" : "") + "}");
  }
  // Data parallelism spans dp and cp: cp's ranks hold the same parameters.
  std::vector<std::string> span;
  if (s.dp > 1) span.push_back("dp");
  if (s.cp > 1) span.push_back("cp");
  const std::string keep = s.keep ? ", reshard_after_forward: false" : "";
  if (s.dp_mode == DpMode::kReplicate) {
    std::string dims;
    for (const auto& d : span) dims += (dims.empty() ? "" : ", ") + d;
    t.push_back("replicate: {mesh_dim: [" + dims + "]}");
  } else if (s.dp_mode == DpMode::kFullyShard) {
    std::string flat;
    for (const auto& d : span) flat += (flat.empty() ? "" : "+") + d;
    t.push_back("fully_shard: {mesh_dim: " + flat + ", units: " + quoted_list(f.units) + keep + "}");
  } else if (s.dp_mode == DpMode::kHsdp) {
    t.push_back("fully_shard: {mesh_dim: [dp_rep, dp_shard], units: " + quoted_list(f.units) + keep + "}");
  }
  if (t.empty()) o << " []";
  for (const auto& x : t) o << "\n  - " << x;
  o << "\n";
  return o.str();
}

// Every shape for `world`: tp within a node, cp 1, 2 or 4, pp up to the layers, the rest dp;
// microbatches as the config gives them (`given` > 0), else searched.
std::vector<Shape> shapes_of(const World& w, const ModelFacts& f, int64_t given) {
  std::vector<Shape> out;
  const int64_t n = w.size();
  for (int64_t tp : divisors(n)) {
    if (tp > w.ranks_per_node) continue;
    for (int64_t cp : divisors(n / tp)) {
      if (cp > 4 || (cp > 1 && !f.has_layers)) continue;
      for (int64_t pp : divisors(n / (tp * cp))) {
        if (pp > 1 && (!f.has_layers || pp > f.layers)) continue;
        const int64_t dp = n / (tp * cp * pp);
        std::vector<std::tuple<DpMode, int64_t, bool>> dps;  // (mode, HSDP's shard, keep unsharded)
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
        std::vector<std::pair<parallel::ScheduleKind, int64_t>> schedules{{parallel::ScheduleKind::k1f1b, 1}};
        if (pp > 1) {
          schedules.push_back({parallel::ScheduleKind::kInterleaved1f1b, 2});
          schedules.push_back({parallel::ScheduleKind::kZbv, 2});
        }
        for (const auto& [mode, sh, keep] : dps) {
          for (const auto& [kind, v] : schedules) {
            for (int64_t mb : {int64_t{1}, int64_t{2}, int64_t{4}}) {
              if (given > 0 && mb > 1) continue;
              for (Ac ac : {Ac::kNone, Ac::kOp, Ac::kFull}) {
                if (ac != Ac::kNone && !f.has_layers) continue;
                const int64_t m = given > 0 ? given
                                  : pp > 1  ? mb * pp * (kind == parallel::ScheduleKind::kZbv ? 2 : 1)
                                            : mb;
                out.push_back(Shape{tp, cp, pp, dp, sh, mode, kind, v, m, ac, keep});
              }
            }
          }
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

// The cost model's step for `s` (see Candidate).
void price(Candidate& cand, const Shape& s, const ModelFacts& f, const ExperimentConfig& c, const World& w,
           double flops) {
  const double n = static_cast<double>(w.size());
  cand.bubble = s.pp > 1 ? parallel::bubble_formula(
                               s.schedule, parallel::shape_for(s.schedule, static_cast<int>(s.pp),
                                                               static_cast<int>(s.virtual_stages),
                                                               static_cast<int>(s.microbatches)))
                         : 0.0;
  const double recompute = s.ac == Ac::kFull ? 4.0 / 3.0 : 1.0;  // full: one more forward (a third of 6N)
  const int64_t rows = std::max<int64_t>(1, c.train.global_batch * f.seq / (s.dp * s.cp * s.microbatches));
  cand.rate = w.matmul_rate ? w.matmul_rate(rows, std::max<int64_t>(1, f.dim), std::max<int64_t>(1, f.dim / s.tp))
                            : w.matmul_flops;
  cand.compute_s = flops * recompute / (n * cand.rate) / (1.0 - cand.bubble);
  // A group is inside a node when its ranks are: the mesh is [pp, dp, cp, tp], tp innermost.
  auto bw = [&](int64_t span) { return span <= w.ranks_per_node ? w.intra_bytes_per_s : w.inter_bytes_per_s; };
  const double e = static_cast<double>(c10::elementSize(scalar_type_of(c.train.dtype)));
  const double tokens = static_cast<double>(c.train.global_batch) * f.seq / static_cast<double>(s.dp * s.cp);
  const double layers_here = static_cast<double>(f.layers) / static_cast<double>(s.pp);
  const double local = f.param_bytes / static_cast<double>(s.tp * s.pp);
  double comm = 0;
  const double span = static_cast<double>(s.dp * s.cp);
  if (s.dp_mode == DpMode::kReplicate) comm += 2 * (span - 1) / span * local / bw(s.dp * s.cp * s.tp);
  // fully_shard: an all-gather in forward, another in backward unless kept, a reduce-scatter.
  const double passes = s.keep ? 2 : 3;
  if (s.dp_mode == DpMode::kFullyShard) comm += passes * (span - 1) / span * local / bw(s.dp * s.cp * s.tp);
  if (s.dp_mode == DpMode::kHsdp) {
    const double sh = static_cast<double>(s.shard), rep = static_cast<double>(s.dp / s.shard);
    comm += passes * (sh - 1) / sh * local / bw(s.shard * s.tp) + 2 * (rep - 1) / rep * local / sh / bw(s.dp * s.tp);
  }
  const double again = s.ac == Ac::kFull ? 1.5 : 1.0;  // a recomputed forward repeats its collectives
  if (s.tp > 1) {
    const double tp = static_cast<double>(s.tp);
    comm += again * 8 * (tp - 1) / tp * tokens * f.dim * e * layers_here / bw(s.tp);
  }
  if (s.cp > 1) comm += again * 3 * (s.cp - 1) * 2.0 * f.kv_dim * tokens * e * layers_here / bw(s.cp * s.tp);
  if (s.pp > 1) comm += 2 * s.virtual_stages * tokens * f.dim * e / bw(w.size());
  cand.comm_s = comm;
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

// A shape the planner accepted, priced.
struct Accepted {
  Candidate cand;
  ExperimentConfig config;
  Plan plan;
};

// Every shape of the world through the planner (`doc`: the config without mesh; `given`: its own
// train.microbatches, 0 when searched), each accepted one priced, in cost order; counts the
// candidates and refusals into `out`.
std::vector<Accepted> priced_plans(const std::string& path, const YAML::Node& doc, const std::string& mesh_extra,
                                   const ModelFacts& f, int64_t given, const World& w, Suggestion& out) {
  const std::string base_text = emit(doc);
  std::vector<Accepted> accepted;
  for (Shape s : shapes_of(w, f, given)) {
    ++out.candidates;
    std::string rest = base_text;  // the config's other sections, with gradient accumulation when searched
    if (!given && s.pp == 1 && s.microbatches > 1) {
      YAML::Node d = YAML::Clone(doc);
      d["train"]["microbatches"] = s.microbatches;
      rest = emit(d);
    }
    for (s.tp_style = 0; s.tp_style < 3; ++s.tp_style) {
      const std::string text = rest + sections(s, f, mesh_extra, given > 0);
      try {
        ExperimentConfig c = parse_config(text, path);
        Plan plan = make_plan(c, w.size());
        Candidate cand;
        cand.name = s.name();
        cand.yaml = text;
        cand.family = s.family();
        price(cand, s, f, c, w, out.flops_per_step);
        accepted.push_back({cand, std::move(c), std::move(plan)});
        break;
      } catch (const UserError& e) {
        if (s.tp > 1 && s.tp_style < 2) continue;  // without sequence or loss parallelism, maybe
        ++out.refused;
        if (out.first_refusal.empty()) out.first_refusal = s.name() + ": " + e.what();
        break;
      }
    }
  }
  std::stable_sort(accepted.begin(), accepted.end(),
                   [](const Accepted& a, const Accepted& b) { return a.cand.step_s() < b.cand.step_s(); });
  return accepted;
}

// In cost order, each plan's memory estimated until `top` fit (or `max_estimates` ran), into out.fitting
// and out.unfit.
void fit_in_cost_order(std::vector<Accepted>& accepted, const World& w, int top, int max_estimates, Suggestion& out) {
  const double limit = (1.0 - w.margin) * static_cast<double>(w.memory_per_rank);
  std::set<std::string> fitted;  // families with a plan that fits: their costlier members buy memory not needed
  for (auto& a : accepted) {
    if (static_cast<int>(out.fitting.size()) >= top || out.estimated >= max_estimates) break;
    if (fitted.count(a.cand.family)) continue;
    ++out.estimated;
    try {
      int64_t peak = 0;
      for (const auto& e : estimate_memory(a.config, a.plan, w.ranks_per_node)) peak = std::max(peak, e.peak());
      a.cand.peak = peak;
      a.cand.fits = static_cast<double>(peak) <= limit;
    } catch (const UserError&) {
      ++out.refused;
      continue;
    }
    if (a.cand.fits) fitted.insert(a.cand.family);
    (a.cand.fits ? out.fitting : out.unfit).push_back(a.cand);
  }
}

}  // namespace

Suggestion suggest(const std::string& path, const std::vector<std::string>& overrides, const World& w, int top,
                   int max_estimates) {
  const YAML::Node base = base_document(path, overrides);
  const std::string mesh_extra = mesh_extra_of(base, w);
  YAML::Node doc = YAML::Clone(base);
  doc.remove("mesh");
  const ExperimentConfig one = parse_config(emit(doc) + "mesh: {shape: [], names: []}\nparallelize: []\n", path);
  const ModelFacts f = facts_of(one);
  const int64_t given = doc["train"] && doc["train"]["microbatches"] ? doc["train"]["microbatches"].as<int64_t>() : 0;
  Suggestion out;
  out.flops_per_step = flops_of(f, one);
  std::vector<Accepted> accepted = priced_plans(path, doc, mesh_extra, f, given, w, out);
  fit_in_cost_order(accepted, w, top, max_estimates, out);
  return out;
}

std::string suggested_yaml(const Suggestion& s, const World& w, size_t pick) {
  TORCH_CHECK(pick < s.fitting.size(), "no plan fits");
  const Candidate& best = s.fitting[pick];
  std::ostringstream o;
  o.precision(3);
  auto line = [&](const Candidate& c) {
    std::ostringstream l;
    l.precision(3);
    l << c.name << ": step " << c.step_s() << " s (compute " << c.compute_s << " s at " << c.rate / 1e12
      << " TFLOP/s, communication " << c.comm_s << " s, bubble " << c.bubble << "), peak " << format_bytes(c.peak);
    return l.str();
  };
  o << "# composer suggest for " << w.nodes << " node(s) x " << w.ranks_per_node << " ranks, "
    << format_bytes(w.memory_per_rank) << " per rank (keeping " << w.margin * 100 << "% free); model FLOPs "
    << s.flops_per_step << " per step, priced at "
    << (w.matmul_rate ? std::string("a matmul rate per rank measured here at each plan's matmul shape")
                      : std::to_string(w.matmul_flops / 1e12) + " TFLOP/s per rank")
    << ", "
    << w.intra_bytes_per_s / 1e9 << " GB/s within a node and " << w.inter_bytes_per_s / 1e9 << " GB/s across.\n"
    << "# " << s.candidates << " plans searched, " << s.refused << " refused by the planner, " << s.estimated
    << " run dry in cost order, " << s.fitting.size() << " fit.\n"
    << "# " << (pick ? "runner-up " + std::to_string(pick + 1) + ": " : "chosen, the cheapest that fits: ")
    << line(best) << "\n";
  for (size_t i = 0; i < s.fitting.size(); ++i) {
    if (i != pick) o << "# " << (i ? "runner-up " + std::to_string(i + 1) : "the best") << ": " << line(s.fitting[i]) << "\n";
  }
  for (const auto& c : s.unfit) o << "# cheaper but over the memory: " << line(c) << "\n";
  o << best.yaml;
  return o.str();
}

double measure_matmul_flops(int64_t rows, int64_t k, int64_t n, double seconds) {
  torch::NoGradGuard no_grad;
  auto a = torch::randn({rows, k}), b = torch::randn({k, n});
  a.mm(b);  // warm-up
  const auto t0 = std::chrono::steady_clock::now();
  int64_t reps = 0;
  double elapsed = 0;
  while (elapsed < seconds) {
    a.mm(b);
    ++reps;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return 2.0 * static_cast<double>(rows * k * n) * static_cast<double>(reps) / elapsed;
}

}  // namespace composer

#include "runner/verify/golden.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <fstream>
#include <sstream>

#include "models/registry.h"
#include "runner/base/errors.h"

namespace composer {
namespace {

const char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string libtorch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

GoldenParam to_golden(const std::string& name, const torch::Tensor& t) {
  GoldenParam p;
  p.name = name;
  p.shape = t.sizes().vec();
  auto flat = t.detach().to(torch::kDouble).flatten().contiguous();
  p.l2 = flat.norm().item<double>();
  const int64_t n = flat.numel();
  if (n > kGoldenFullLimit) {
    p.sampled = true;
    auto idx = (torch::arange(kGoldenSamples, torch::kLong) * n).div(kGoldenSamples, "floor");
    p.values = flat.index_select(0, idx);
  } else {
    p.values = flat;
  }
  return p;
}

nlohmann::json param_json(const GoldenParam& p) {
  auto f = p.values.contiguous();
  std::string raw(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(double));
  return {{"name", p.name}, {"shape", p.shape}, {"l2", p.l2}, {"sampled", p.sampled},
          {"float64_base64", base64_encode(raw)}};
}

struct Err {
  double abs, rel;
  bool ok;
};

Err err_of(double expected, double actual, double rtol, double atol) {
  double a = std::fabs(actual - expected);
  double r = a / std::max(std::fabs(expected), 1e-30);
  bool ok = a <= atol + rtol * std::fabs(expected) && std::isfinite(actual);
  return {a, r, ok};
}

std::string describe(const std::string& what, double e, double a, const Err& err, double rtol, double atol) {
  std::ostringstream os;
  os.precision(9);
  os << what << ": expected " << e << ", actual " << a << ", abs err " << err.abs << ", rel err " << err.rel
     << " (rtol " << rtol << ", atol " << atol << ")";
  return os.str();
}

void fail(CompareReport& r, const std::string& message) {
  if (r.ok) r.first_failure = message;
  r.ok = false;
  ++r.failures;
}

void compare_steps(const Golden& g, const ExperimentConfig& c, const std::vector<StepRecord>& steps,
                   CompareReport& r) {
  const double rtol = c.check.loss_rtol, atol = c.check.loss_atol;
  if (steps.size() != g.steps.size()) {
    fail(r, "the golden has " + std::to_string(g.steps.size()) + " steps, the run " + std::to_string(steps.size()));
    return;
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto &e = g.steps[i], &a = steps[i];
    for (auto [what, ev, av] : {std::tuple<const char*, double, double>{"loss", e.loss, a.loss},
                                {"grad_norm", e.grad_norm, a.grad_norm}}) {
      Err err = err_of(ev, av, rtol, atol);
      r.max_tolerance_used = std::max(r.max_tolerance_used, err.abs / std::max(atol + rtol * std::fabs(ev), 1e-300));
      if (std::string(what) == "loss") {
        r.max_loss_abs_err = std::max(r.max_loss_abs_err, err.abs);
        r.max_loss_rel_err = std::max(r.max_loss_rel_err, err.rel);
      } else {
        r.max_grad_norm_rel_err = std::max(r.max_grad_norm_rel_err, err.rel);
      }
      if (!err.ok && r.ok) r.first_failure_step = e.step;
      if (!err.ok) fail(r, describe("step " + std::to_string(e.step) + " " + what, ev, av, err, rtol, atol));
    }
    if (e.has_eval && a.has_eval) {  // a golden made with eval checks a run with it; eval does not change training
      Err err = err_of(e.eval_loss, a.eval_loss, rtol, atol);
      r.max_eval_rel_err = std::max(r.max_eval_rel_err, err.rel);
      r.max_tolerance_used = std::max(r.max_tolerance_used, err.abs / std::max(atol + rtol * std::fabs(e.eval_loss), 1e-300));
      ++r.eval_losses;
      if (!err.ok) {
        if (r.ok) r.first_failure_step = e.step;
        fail(r, describe("step " + std::to_string(e.step) + " eval_loss", e.eval_loss, a.eval_loss, err, rtol, atol));
      }
    }
  }
}

void compare_params(const Golden& g, const ExperimentConfig& c, const NamedTensors& params, CompareReport& r) {
  const double rtol = c.check.param_rtol, atol = c.check.param_atol;
  std::map<std::string, torch::Tensor> actual(params.begin(), params.end());
  for (const auto& p : g.params) {
    auto it = actual.find(p.name);
    if (it == actual.end()) {
      fail(r, "parameter " + p.name + " is in the golden but not in the run");
      continue;
    }
    if (it->second.sizes().vec() != p.shape) {
      fail(r, "parameter " + p.name + ": golden shape " + c10::str(c10::IntArrayRef(p.shape)) + ", run shape " +
                  c10::str(it->second.sizes()));
      continue;
    }
    GoldenParam a = to_golden(p.name, it->second);
    auto diff = (a.values - p.values).abs();
    auto bound = atol + rtol * p.values.abs();
    auto rel = diff / p.values.abs().clamp_min(1e-30);
    double max_abs = diff.numel() ? diff.max().item<double>() : 0.0;
    if (max_abs >= r.max_param_abs_err) {
      r.max_param_abs_err = max_abs;
      r.worst_param = p.name;
    }
    if (rel.numel()) r.max_param_rel_err = std::max(r.max_param_rel_err, rel.max().item<double>());
    if (diff.numel()) r.max_tolerance_used = std::max(r.max_tolerance_used, (diff / bound.clamp_min(1e-300)).max().item<double>());
    auto bad = (diff > bound).logical_or(a.values.isnan());
    if (bad.any().item<bool>()) {
      int64_t i = bad.nonzero()[0][0].item<int64_t>();
      double ev = p.values[i].item<double>(), av = a.values[i].item<double>();
      int64_t flat = p.sampled ? i * a.values.numel() / kGoldenSamples : i;
      fail(r, describe("parameter " + p.name + " element " + std::to_string(flat), ev, av,
                       err_of(ev, av, rtol, atol), rtol, atol));
    }
    Err l2 = err_of(p.l2, a.l2, rtol, atol);
    if (p.sampled && !l2.ok) fail(r, describe("parameter " + p.name + " L2 norm", p.l2, a.l2, l2, rtol, atol));
    actual.erase(it);
  }
  // A weight buffer (nn::named_weight_buffers) counts where the golden holds it: goldens written before
  // weights files carried buffers have none.
  std::set<std::string> buffers;
  if (!actual.empty()) {
    nn::ShapeOnly shapes;
    models::ModelPtr model = models::find_model(c.model.name)->build(c.model.args);
    for (const auto& b : nn::named_weight_buffers(*model)) buffers.insert(b.first);
  }
  for (const auto& [name, t] : actual) {
    if (!buffers.count(name)) fail(r, "parameter " + name + " is in the run but not in the golden");
  }
}

// The rounding a golden was trained under (tools/reference's mixed-precision
// options), in words; "" for none.
std::string golden_policy(const nlohmann::json& header) {
  if (header.contains("param_dtype")) {
    return header["param_dtype"].get<std::string>() + " compute, " + header.value("reduce_dtype", std::string("?")) +
           " gradient reduction";
  }
  if (header.contains("all_gather")) return header["all_gather"].get<std::string>() + " all-gather";
  return "";
}

}  // namespace

// The same for a plan: its fully_shard's param_dtype and reduce_dtype, or its
// all-gather extension when that rounds (split_bfloat16 is exact).
std::string plan_policy(const ExperimentConfig& c) {
  std::string have;
  for (const auto& entry : c.parallelize) {
    const auto* fs = std::get_if<FullyShardConfig>(&entry.options);
    if (!fs) continue;
    const FullyShardConfig& t = *fs;
    if (t.param_dtype) {
      have = std::string(name_of(*t.param_dtype)) + " compute, " + name_of(t.reduce_dtype.value_or(*t.param_dtype)) +
             " gradient reduction";
    } else if (t.all_gather == AllGather::kBfloat16) {
      have = std::string(name_of(t.all_gather)) + " all-gather";
    }
  }
  return have;
}

namespace {

// An integer field, read only when it is one (nlohmann converts a float by a
// cast, undefined when it does not fit).
int64_t integer_field(const nlohmann::json& v, const std::string& what, const std::string& path) {
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX)) {
    throw FileError(path, "malformed golden file: " + what + " must be an integer, got " + v.dump());
  }
  return v.get<int64_t>();
}

// Reads a golden file's header fields into g.header; refuses another format version.
void parse_golden_header(const nlohmann::json& j, const std::string& path, Golden& g) {
  if (integer_field(j.at("format_version"), "format_version", path) != kGoldenFormat) {
    throw FileError(path, "golden format_version " + j["format_version"].dump() + " is not " +
                              std::to_string(kGoldenFormat) + "; regenerate it");
  }
  for (auto key : {"format_version", "generator", "name", "command", "config_hash", "libtorch_version", "dtype"}) {
    g.header[key] = j.at(key);
  }
  // A golden trained under a mixed-precision policy (tools/reference --param-dtype or
  // --all-gather) names it.
  for (auto key : {"param_dtype", "reduce_dtype", "all_gather"}) {
    if (j.contains(key)) g.header[key] = j.at(key).get<std::string>();
  }
}

// One entry of a golden file's steps.
StepRecord parse_golden_step(const nlohmann::json& s, const std::string& path) {
  StepRecord r;
  r.step = integer_field(s.at("step"), "step", path);
  r.loss = s.at("loss").get<double>();
  r.grad_norm = s.at("grad_norm").get<double>();
  r.lr = s.at("lr").get<double>();
  if (s.contains("eval_loss")) {
    r.has_eval = true;
    r.eval_loss = s.at("eval_loss").get<double>();
  }
  return r;
}

// One entry of a golden file's params; refuses a shape that overflows or values that do not match it.
GoldenParam parse_golden_param(const nlohmann::json& p, const std::string& path) {
  GoldenParam gp;
  gp.name = p.at("name").get<std::string>();
  if (!p.at("shape").is_array()) throw FileError(path, "malformed golden file: " + gp.name + "'s shape is not a list");
  int64_t numel = 1;
  for (const auto& s : p.at("shape")) {
    const int64_t size = integer_field(s, gp.name + "'s shape", path);
    if (size < 0 || __builtin_mul_overflow(numel, size, &numel)) {
      throw FileError(path, "malformed golden file: " + gp.name + " has shape " + p.at("shape").dump());
    }
    gp.shape.push_back(size);
  }
  gp.l2 = p.at("l2").get<double>();
  gp.sampled = p.at("sampled").get<bool>();
  std::string raw = base64_decode(p.at("float64_base64").get<std::string>());
  int64_t expect = gp.sampled ? kGoldenSamples : numel;
  if (raw.size() != static_cast<size_t>(expect) * sizeof(double)) {
    throw FileError(path, "parameter " + gp.name + " holds " + std::to_string(raw.size() / 8) +
                              " values but its shape needs " + std::to_string(expect));
  }
  gp.values = torch::empty({expect}, torch::kDouble);
  std::memcpy(gp.values.data_ptr(), raw.data(), raw.size());
  return gp;
}

}  // namespace

std::string base64_encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kB64[(v >> s) & 63];
  }
  if (i < in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    if (i + 1 < in.size()) v |= uint8_t(in[i + 1]) << 8;
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string base64_decode(const std::string& in) {
  if (in.size() % 4 != 0) throw std::invalid_argument("base64 length is not a multiple of 4");
  std::string out;
  uint32_t v = 0;
  int bits = 0;
  for (char ch : in) {
    if (ch == '=') break;
    const char* pos = std::strchr(kB64, ch);
    if (!pos || ch == '\0') throw std::invalid_argument("invalid base64 character");
    v = (v << 6) | static_cast<uint32_t>(pos - kB64);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((v >> bits) & 0xff);
    }
  }
  return out;
}

std::string golden_init_path(const std::string& golden_path) {
  const std::string ext = ".json";
  const bool json = golden_path.size() >= ext.size() && golden_path.compare(golden_path.size() - ext.size(), ext.size(), ext) == 0;
  return (json ? golden_path.substr(0, golden_path.size() - ext.size()) : golden_path) + ".init.safetensors";
}

bool draws_initial_weights(const ModelConfig& m) { return m.init_from.empty() && m.from_hf.empty(); }

Golden make_golden(const ExperimentConfig& c, const std::vector<StepRecord>& steps, const NamedTensors& params,
                   const std::string& command) {
  Golden g;
  g.header = {{"format_version", kGoldenFormat},
              {"generator", "composer"},
              {"name", c.name},
              {"command", command},
              {"config_hash", config_hash(c)},
              {"libtorch_version", libtorch_version()},
              {"dtype", name_of(c.train.dtype)}};
  g.steps = steps;
  for (const auto& [name, t] : params) g.params.push_back(to_golden(name, t));
  return g;
}

void write_golden(const std::string& path, const Golden& g) {
  nlohmann::json j = g.header;
  j["steps"] = nlohmann::json::array();
  for (const auto& s : g.steps) {
    j["steps"].push_back({{"step", s.step}, {"loss", s.loss}, {"grad_norm", s.grad_norm}, {"lr", s.lr}});
    if (s.has_eval) j["steps"].back()["eval_loss"] = s.eval_loss;
  }
  j["params"] = nlohmann::json::array();
  for (const auto& p : g.params) j["params"].push_back(param_json(p));
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(1) << "\n";
    if (!out) throw RuntimeFailure("cannot write golden file " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw RuntimeFailure("cannot rename " + tmp + " to " + path);
}

std::optional<std::string> degenerate_steps(const std::vector<StepRecord>& steps) {
  for (auto [key, field] : {std::pair<const char*, double StepRecord::*>{"loss", &StepRecord::loss},
                             {"grad_norm", &StepRecord::grad_norm}}) {
    std::string zero;
    bool constant = steps.size() > 1;
    for (const auto& r : steps) {
      if (r.*field == 0) zero += (zero.empty() ? "" : ", ") + std::to_string(r.step);
      constant = constant && r.*field == steps.front().*field;
    }
    if (!zero.empty()) return std::string(key) + " is 0 at step(s) " + zero;
    if (constant) return std::string(key) + " is the same at every step";
  }
  return std::nullopt;
}

Golden read_golden(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    throw FileError(path, "no golden file; write one with `composer golden --config <file>` or tools/reference");
  }
  std::stringstream text;
  text << in.rdbuf();
  return parse_golden(text.str(), path);
}

Golden parse_golden(const std::string& text, const std::string& path) {
  Golden g;
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    parse_golden_header(j, path, g);
    for (const auto& s : j.at("steps")) g.steps.push_back(parse_golden_step(s, path));
    for (const auto& p : j.at("params")) g.params.push_back(parse_golden_param(p, path));
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("malformed golden file: ") + e.what());
  } catch (const std::invalid_argument& e) {
    throw FileError(path, std::string("malformed golden file: ") + e.what());
  }
  return g;
}

void check_golden_header(const Golden& g, const ExperimentConfig& c) {
  if (g.header.at("config_hash") != config_hash(c)) {
    throw CheckFailed("golden " + golden_path(c) + " was made for config hash " +
                      g.header["config_hash"].get<std::string>() + " but this config hashes to " + config_hash(c) +
                      " (seed, model, train or data differ); regenerate the golden or restore the config");
  }
  if (g.header.at("dtype") != name_of(c.train.dtype)) {
    throw CheckFailed("golden dtype " + g.header["dtype"].get<std::string>() + " differs from train.dtype " +
                      name_of(c.train.dtype));
  }
  const std::string want = golden_policy(g.header);
  if (!want.empty()) {
    // Such a golden is only the single-device result of a plan that rounds the same way.
    const std::string have = plan_policy(c);
    if (have != want) {
      const std::string plan = have.empty() ? std::string("no mixed precision") : have;
      throw CheckFailed("golden " + golden_path(c) + " was trained with " + want +
                        " (fully_shard's mixed precision) but this plan computes with " + plan +
                        "; set fully_shard's param_dtype, reduce_dtype and all_gather to match, or use a float32 "
                        "golden");
    }
  }
}

CompareReport compare(const Golden& g, const ExperimentConfig& c, const std::vector<StepRecord>& steps,
                      const NamedTensors& params) {
  check_golden_header(g, c);
  CompareReport r;
  compare_steps(g, c, steps, r);
  r.step_failures = r.failures;
  compare_params(g, c, params, r);
  r.param_failures = r.failures - r.step_failures;
  return r;
}

}  // namespace composer

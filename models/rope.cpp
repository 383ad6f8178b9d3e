#include "models/rope.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "models/hf_adapter.h"
#include "models/model_decl.h"

namespace composer::models {
namespace {

// The scaling arguments each rope_type reads (rope_theta: every type).
const std::vector<std::string>& used_by(const std::string& type) {
  static const std::vector<std::string> none, llama3 = {"rope_factor", "rope_low_freq_factor",
                                                         "rope_high_freq_factor", "rope_original_max_seq_len"},
                                              yarn = {"rope_factor",    "rope_original_max_seq_len", "rope_beta_fast",
                                                      "rope_beta_slow", "rope_mscale",               "rope_mscale_all_dim",
                                                      "rope_attention_factor", "rope_truncate"};
  return type == "llama3" ? llama3 : type == "yarn" ? yarn : none;
}

std::string number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// YaRN's attention scaling of a context `scale` times longer (transformers' get_mscale).
double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// The context the table was trained for: rope_original_max_seq_len, 0 meaning max_seq_len.
int64_t original_length(const ModelArgs& a) {
  return a.i("rope_original_max_seq_len") > 0 ? a.i("rope_original_max_seq_len") : a.i("max_seq_len");
}

}  // namespace

std::vector<ArgSpec> rope_args() {
  std::vector<ArgSpec> args = {
          float_arg("rope_theta", 10000.0, "rotary embedding base"),
          string_arg("rope_type", "default",
                     "rotary scaling: default (none), llama3 (Llama 3.1 and later), yarn (DeepSeek-V3, long-context "
                     "Qwen3)"),
          float_arg("rope_factor", 1.0, "llama3 and yarn: how many times longer a context than the original"),
          float_arg("rope_low_freq_factor", 1.0, "llama3: wavelengths above original / this are scaled by rope_factor"),
          float_arg("rope_high_freq_factor", 4.0, "llama3: wavelengths below original / this are kept"),
          int_arg("rope_original_max_seq_len", 0,
                  "llama3 and yarn: the context the model was trained for; 0 means max_seq_len"),
          float_arg("rope_beta_fast", 32.0, "yarn: rotations below which dims are scaled (the ramp's low end)"),
          float_arg("rope_beta_slow", 1.0, "yarn: rotations above which dims are kept (the ramp's high end)"),
          float_arg("rope_mscale", 0.0, "yarn: attention scaling's mscale; 0 means none"),
          float_arg("rope_mscale_all_dim", 0.0, "yarn: attention scaling's mscale_all_dim; 0 means none"),
          float_arg("rope_attention_factor", 0.0, "yarn: cos and sin are scaled by this; 0 derives it from rope_factor"),
          bool_arg("rope_truncate", true, "yarn: round the ramp's ends to whole dims")};
  // The resolved config lists the scaling only where a config uses it (the goldens' hashes predate it).
  for (size_t i = 1; i < args.size(); ++i) args[i] = quiet(args[i]);
  return args;
}

void check_rope_args(const ModelArgs& a) {
  const std::string& type = a.s("rope_type");
  if (type != "default" && type != "llama3" && type != "yarn") {
    throw ArgError("rope_type", "rope_type '" + type + "' is not one of default, llama3, yarn");
  }
  if (!(a.f("rope_theta") > 0)) throw ArgError("rope_theta", "rope_theta must be positive, got " + number(a.f("rope_theta")));
  // A scaling argument the rope_type does not read would be ignored: refused, by name.
  for (const ArgSpec& spec : rope_args()) {
    if (spec.name == "rope_theta" || spec.name == "rope_type") continue;
    const auto& used = used_by(type);
    if (std::find(used.begin(), used.end(), spec.name) != used.end()) continue;
    if (a.values().at(spec.name) == spec.default_value) continue;
    std::string users;
    for (const char* t : {"llama3", "yarn"}) {
      const auto& u = used_by(t);
      if (std::find(u.begin(), u.end(), spec.name) != u.end()) users += (users.empty() ? "" : " or ") + std::string(t);
    }
    throw ArgError(spec.name, spec.name + " applies to rope_type " + users + ", not " + type +
                                  "; remove it or set rope_type: " + users.substr(0, users.find(' ')));
  }
  if (type == "default") return;
  if (!(a.f("rope_factor") > 0)) throw ArgError("rope_factor", "rope_factor must be positive, got " + number(a.f("rope_factor")));
  if (a.i("rope_original_max_seq_len") < 0) {
    throw ArgError("rope_original_max_seq_len", "rope_original_max_seq_len must be 0 (max_seq_len) or positive");
  }
  if (type == "llama3") {
    if (!(a.f("rope_low_freq_factor") > 0) || !(a.f("rope_high_freq_factor") > a.f("rope_low_freq_factor"))) {
      throw ArgError("rope_high_freq_factor", "llama3 rope scaling needs 0 < rope_low_freq_factor < "
                                              "rope_high_freq_factor, got " + number(a.f("rope_low_freq_factor")) +
                                                  " and " + number(a.f("rope_high_freq_factor")));
    }
    return;
  }
  if (!(a.f("rope_beta_fast") > 0) || !(a.f("rope_beta_slow") > 0)) {
    throw ArgError("rope_beta_fast", "yarn's rope_beta_fast and rope_beta_slow must be positive");
  }
  for (auto n : {"rope_mscale", "rope_mscale_all_dim", "rope_attention_factor"}) {
    if (!(a.f(n) >= 0)) throw ArgError(n, std::string(n) + " must be 0 (none) or positive, got " + number(a.f(n)));
  }
}

// Each step as transformers' modeling_rope_utils writes it in float32; where
// Python divides a number by a tensor it multiplies by the tensor's reciprocal
// (Tensor.__rtruediv__), and so does this.
RopeFrequencies rope_frequencies(const ModelArgs& a, int64_t dim) {
  const double base = a.f("rope_theta");
  const torch::Tensor pos_freqs =
      torch::pow(base, torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(dim));
  const torch::Tensor inv_freq = pos_freqs.reciprocal();
  const std::string& type = a.s("rope_type");
  const double factor = a.f("rope_factor");
  const double original = static_cast<double>(original_length(a));
  if (type == "llama3") {
    const double low = a.f("rope_low_freq_factor"), high = a.f("rope_high_freq_factor");
    const double low_freq_wavelen = original / low, high_freq_wavelen = original / high;
    const torch::Tensor wavelen = inv_freq.reciprocal() * (2 * M_PI);
    torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
    const torch::Tensor smooth = (wavelen.reciprocal() * original - low) / (high - low);
    const torch::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    const torch::Tensor medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
    return {torch::where(medium, smoothed, scaled), 1.0};
  }
  if (type == "yarn") {
    double scaling = a.f("rope_attention_factor");
    if (scaling == 0) {
      const double m = a.f("rope_mscale"), m_all = a.f("rope_mscale_all_dim");
      scaling = m != 0 && m_all != 0 ? yarn_mscale(factor, m) / yarn_mscale(factor, m_all) : yarn_mscale(factor, 1);
    }
    // The dims whose wavelength turns `rotations` times over the original context.
    auto correction_dim = [&](double rotations) {
      return (dim * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(base));
    };
    double low = correction_dim(a.f("rope_beta_fast")), high = correction_dim(a.f("rope_beta_slow"));
    if (a.b("rope_truncate")) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    const torch::Tensor ramp = torch::clamp((torch::arange(dim / 2, torch::kFloat) - low) / (high - low), 0, 1);
    const torch::Tensor extrapolation = 1 - ramp;
    const torch::Tensor interpolation_freq = (pos_freqs * factor).reciprocal();
    return {interpolation_freq * (1 - extrapolation) + inv_freq * extrapolation, scaling};
  }
  return {inv_freq, 1.0};
}

std::pair<torch::Tensor, torch::Tensor> rope_tables(const ModelArgs& a, int64_t dim, int64_t positions) {
  const RopeFrequencies f = rope_frequencies(a, dim);
  const torch::Tensor angles = torch::outer(torch::arange(positions).to(torch::kFloat), f.inv_freq);
  torch::Tensor cos = angles.cos(), sin = angles.sin();
  if (f.scaling != 1.0) {
    cos = cos * f.scaling;
    sin = sin * f.scaling;
  }
  return {cos, sin};
}

double rope_softmax_scale(const ModelArgs& a) {
  if (a.s("rope_type") == "default" || a.f("rope_mscale_all_dim") == 0) return 1.0;
  const double m = yarn_mscale(a.f("rope_factor"), a.f("rope_mscale_all_dim"));
  return m * m;
}

std::pair<torch::Tensor, torch::Tensor> rope_rows(nn::SequenceSlot& slot, const torch::Tensor& cos,
                                                  const torch::Tensor& sin, int64_t b, int64_t s,
                                                  const c10::Device& device) {
  if (!slot.split && !slot.doc_start().defined()) {
    return {cos.slice(0, 0, s).to(device), sin.slice(0, 0, s).to(device)};
  }
  // The angles of this rank's positions in a longer sequence, or of each token's position in its
  // document ((b, s) positions: angles per sample).
  auto pos = nn::positions(&slot, s, cos.device());
  const std::vector<int64_t> shape = pos.dim() == 2 ? std::vector<int64_t>{b, s, -1} : std::vector<int64_t>{s, -1};
  return {cos.index_select(0, pos.flatten()).view(shape).to(device),
          sin.index_select(0, pos.flatten()).view(shape).to(device)};
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (x.is_cuda()) {
    auto xc = torch::view_as_complex(x.to(torch::kFloat).reshape({x.size(0), x.size(1), x.size(2), -1, 2}));
    auto freqs = torch::complex(cos, sin).view({cos.dim() == 3 ? x.size(0) : 1, x.size(1), 1, -1});
    return torch::view_as_real(xc * freqs).flatten(3).to(x.scalar_type());
  }
  auto xf = x.to(torch::kFloat);
  auto pairs = xf.reshape({x.size(0), x.size(1), x.size(2), -1, 2});
  auto x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
  const int64_t rows = cos.dim() == 3 ? x.size(0) : 1;  // per sample: packed documents' positions
  auto c = cos.view({rows, x.size(1), 1, -1}), s = sin.view({rows, x.size(1), 1, -1});
  auto out = torch::stack({x0 * c - x1 * s, x0 * s + x1 * c}, -1).flatten(3);
  return out.to(x.scalar_type());
}

namespace hf {
namespace {

// config.json's rope fields and the arguments they set, per rope_type.
const std::pair<const char*, const char*> kRopeFields[] = {
    {"factor", "rope_factor"},
    {"low_freq_factor", "rope_low_freq_factor"},
    {"high_freq_factor", "rope_high_freq_factor"},
    {"original_max_position_embeddings", "rope_original_max_seq_len"},
    {"beta_fast", "rope_beta_fast"},
    {"beta_slow", "rope_beta_slow"},
    {"mscale", "rope_mscale"},
    {"mscale_all_dim", "rope_mscale_all_dim"},
    {"attention_factor", "rope_attention_factor"},
    {"truncate", "rope_truncate"}};

}  // namespace

void read_rope(const nlohmann::json& j, double theta, ModelArgs& args) {
  // transformers' standardize_rope_params: rope_scaling (older files) wins over rope_parameters, and the
  // top-level rope_theta moves into it.
  const bool legacy = given(j, "rope_scaling");
  const std::string where = legacy ? "rope_scaling" : "rope_parameters";
  nlohmann::json r = nlohmann::json::object();
  if (legacy || given(j, "rope_parameters")) {
    r = j.at(where);
    if (!r.is_object()) throw HfError(where + " " + shown(r) + ": expected an object");
  }
  theta = float_field(j, "rope_theta", theta);
  theta = float_field(r, "rope_theta", theta);
  std::string type = r.value("rope_type", r.value("type", std::string("default")));
  if (type != "default" && type != "llama3" && type != "yarn") {
    throw HfError(where + ".rope_type '" + type +
                  "': composer computes the default, llama3 and yarn rotary embeddings; use a model with one of them");
  }
  args.set("rope_theta", theta);
  args.set("rope_type", type);
  const auto& used = used_by(type);
  for (const auto& [key, value] : r.items()) {
    if (key == "rope_type" || key == "type" || key == "rope_theta" || value.is_null()) continue;
    if (key == "partial_rotary_factor" && value.is_number() && value.get<double>() == 1.0) continue;
    const char* arg = nullptr;
    for (const auto& [field, a] : kRopeFields) {
      if (key == field) arg = a;
    }
    if (!arg || std::find(used.begin(), used.end(), arg) == used.end()) {
      throw HfError(where + "." + key + " " + shown(value) + ": composer's " + type +
                    " rotary embedding has no such parameter; remove it");
    }
    if (std::string(arg) == "rope_truncate") {
      args.set(arg, bool_field(r, key, true));
    } else if (std::string(arg) == "rope_original_max_seq_len") {
      args.set(arg, positive_field(r, key, nullptr, where));
    } else {
      args.set(arg, float_field(r, key, 0.0));
    }
  }
  if (type == "default") return;
  const int64_t max_positions = int_field(j, "max_position_embeddings", nullptr, "config.json");
  if (!given(r, "original_max_position_embeddings")) args.set("rope_original_max_seq_len", max_positions);
  if (type == "llama3") {
    for (auto key : {"factor", "low_freq_factor", "high_freq_factor"}) {
      if (!given(r, key)) throw HfError(where + "." + key + " is missing: llama3 rope scaling needs it");
    }
  } else if (!given(r, "factor")) {  // yarn: the ratio of the two context lengths
    args.set("rope_factor", static_cast<double>(max_positions) / static_cast<double>(args.i("rope_original_max_seq_len")));
  }
}

nlohmann::ordered_json rope_json(const ModelArgs& a) {
  nlohmann::ordered_json r;
  r["rope_theta"] = a.f("rope_theta");
  r["rope_type"] = a.s("rope_type");
  const auto& used = used_by(a.s("rope_type"));
  for (const auto& [field, arg] : kRopeFields) {
    if (std::find(used.begin(), used.end(), arg) == used.end()) continue;
    if (std::string(arg) == "rope_truncate") {
      if (!a.b(arg)) r[field] = false;  // true: transformers' default, left out as its files leave it
    } else if (std::string(arg) == "rope_original_max_seq_len") {
      r[field] = original_length(a);
    } else if ((std::string(arg) == "rope_mscale" || std::string(arg) == "rope_mscale_all_dim" ||
                std::string(arg) == "rope_attention_factor") &&
               a.f(arg) == 0) {
      continue;  // none: transformers derives it
    } else {
      r[field] = a.f(arg);
    }
  }
  return r;
}

}  // namespace hf
}  // namespace composer::models

#include "models/hf_adapter.h"

#include <regex>

namespace composer::models {

// A vector (a per-head norm's weight) is one column.
torch::Tensor rotary_pairs_to_halves(const torch::Tensor& w, int64_t heads) {
  const int64_t head_dim = w.size(0) / heads, dim = w.dim() == 1 ? 1 : w.size(1);
  return w.view({heads, head_dim / 2, 2, dim}).transpose(1, 2).reshape(w.sizes());
}

torch::Tensor rotary_halves_to_pairs(const torch::Tensor& w, int64_t heads) {
  const int64_t head_dim = w.size(0) / heads, dim = w.dim() == 1 ? 1 : w.size(1);
  return w.view({heads, 2, head_dim / 2, dim}).transpose(1, 2).reshape(w.sizes());
}

namespace hf {

std::string shown(const nlohmann::json& v) { return v.dump(); }

bool given(const nlohmann::json& j, const std::string& key) { return j.contains(key) && !j.at(key).is_null(); }

int64_t int_field(const nlohmann::json& j, const std::string& key, const int64_t* fallback, const std::string& model) {
  if (!given(j, key)) {
    if (fallback) return *fallback;
    throw HfError("missing field '" + key + "' that " + model + " has");
  }
  const auto& v = j.at(key);
  if (!v.is_number_integer()) throw HfError(key + " " + shown(v) + ": expected an integer");
  return v.get<int64_t>();
}

int64_t positive_field(const nlohmann::json& j, const std::string& key, const int64_t* fallback,
                       const std::string& model) {
  const int64_t v = int_field(j, key, fallback, model);
  if (v <= 0) throw HfError(key + " " + std::to_string(v) + ": expected a positive integer");
  return v;
}

double float_field(const nlohmann::json& j, const std::string& key, double fallback) {
  if (!given(j, key)) return fallback;
  const auto& v = j.at(key);
  if (!v.is_number()) throw HfError(key + " " + shown(v) + ": expected a number");
  return v.get<double>();
}

bool bool_field(const nlohmann::json& j, const std::string& key, bool fallback) {
  if (!given(j, key)) return fallback;
  const auto& v = j.at(key);
  if (!v.is_boolean()) throw HfError(key + " " + shown(v) + ": expected true or false");
  return v.get<bool>();
}

void require_field(const nlohmann::json& j, const std::string& key, const nlohmann::json& want, const std::string& why) {
  if (!given(j, key) || j.at(key) == want) return;
  throw HfError(key + " " + shown(j.at(key)) + ": " + why);
}

void require_architecture(const nlohmann::json& j, const std::string& arch) {
  if (!j.contains("architectures") || !j.at("architectures").is_array()) return;
  for (const auto& a : j.at("architectures")) {
    if (a != arch) {
      throw HfError("architectures " + shown(j.at("architectures")) + ": composer reads model_type \"" +
                    j.value("model_type", std::string()) + "\" as " + arch + " (a causal language model head)");
    }
  }
}

namespace {
const std::pair<const char*, const char*> kTopNames[] = {
    {"model.embed_tokens.weight", "tok_embeddings.weight"}, {"model.norm.weight", "norm.weight"},
    {"lm_head.weight", "output.weight"}};
}  // namespace

std::string top_hf_name(const std::string& name) {
  for (const auto& [h, c] : kTopNames) {
    if (name == c) return h;
  }
  return "";
}

std::string top_name_of(const std::string& hf) {
  for (const auto& [h, c] : kTopNames) {
    if (hf == h) return c;
  }
  return "";
}

bool split_layer(const std::string& name, bool from_hf, int64_t& layer, std::string& rest) {
  static const std::regex composer_layer(R"(layers\.(0|[1-9]\d{0,8})\.(.+))");
  static const std::regex hf_layer(R"(model\.layers\.(0|[1-9]\d{0,8})\.(.+))");
  std::smatch m;
  if (!std::regex_match(name, m, from_hf ? hf_layer : composer_layer)) return false;
  layer = std::stoll(m[1].str());
  rest = m[2].str();
  return true;
}

std::string renamed(const std::string& name, bool from_hf,
                    const std::function<std::string(int64_t layer, const std::string& rest)>& rest_of) {
  int64_t layer = 0;
  std::string rest;
  if (!split_layer(name, from_hf, layer, rest)) return from_hf ? top_name_of(name) : top_hf_name(name);
  const std::string other = rest_of(layer, rest);
  return other.empty() ? "" : layer_prefix(layer, !from_hf) + other;
}

std::string layer_prefix(int64_t layer, bool hf) { return (hf ? "model.layers." : "layers.") + std::to_string(layer) + "."; }

std::string expert_hf_name(const std::string& rest, const ExpertNames& n, int64_t expert) {
  static const std::regex stacked(R"(feed_forward\.experts\.w([123]))");
  std::smatch e;
  if (!std::regex_match(rest, e, stacked) || expert < 0) return "";
  return n.prefix + std::to_string(expert) + "." + n.weight[std::stoi(e[1].str()) - 1] + ".weight";
}

std::string expert_name_of(const std::string& hf_rest, const ExpertNames& n, int64_t* expert) {
  static const std::regex one(R"((0|[1-9]\d{0,8})\.(\w+)\.weight)");
  const std::string prefix = n.prefix;
  std::smatch e;
  if (hf_rest.rfind(prefix, 0) != 0) return "";
  const std::string tail = hf_rest.substr(prefix.size());
  if (!std::regex_match(tail, e, one)) return "";
  for (int w = 0; w < 3; ++w) {
    if (e[2].str() != n.weight[w]) continue;
    if (expert) *expert = std::stoll(e[1].str());
    return "feed_forward.experts.w" + std::to_string(w + 1);
  }
  return "";
}

bool stacked_expert(const std::string& name) {
  static const std::regex stacked(R"(layers\.\d+\.feed_forward\.experts\.w[123])");
  return std::regex_match(name, stacked);
}

}  // namespace hf
}  // namespace composer::models

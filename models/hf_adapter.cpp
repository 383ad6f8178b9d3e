#include "models/hf_adapter.h"

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

}  // namespace hf
}  // namespace composer::models

#include "runner/config/hf_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "runner/base/errors.h"

namespace composer {
namespace {

// config.json's integer fields and the llama arguments they give.
const std::pair<const char*, const char*> kIntFields[] = {{"hidden_size", "dim"},
                                                          {"intermediate_size", "hidden_dim"},
                                                          {"num_hidden_layers", "n_layers"},
                                                          {"num_attention_heads", "n_heads"},
                                                          {"num_key_value_heads", "n_kv_heads"},
                                                          {"vocab_size", "vocab_size"},
                                                          {"max_position_embeddings", "max_seq_len"}};

std::string shown(const nlohmann::json& v) { return v.dump(); }

// Field `key` of `j` as an integer; a FileError when absent (unless `fallback`) or of another type.
int64_t int_field(const nlohmann::json& j, const std::string& key, const std::string& path, const int64_t* fallback) {
  if (!j.contains(key) || j.at(key).is_null()) {
    if (fallback) return *fallback;
    throw FileError(path, "missing field '" + key + "' that a Llama config.json has");
  }
  const auto& v = j.at(key);
  if (!v.is_number_integer()) throw FileError(path, key + " " + shown(v) + ": expected an integer");
  return v.get<int64_t>();
}

double float_field(const nlohmann::json& j, const std::string& key, const std::string& path, double fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const auto& v = j.at(key);
  if (!v.is_number()) throw FileError(path, key + " " + shown(v) + ": expected a number");
  return v.get<double>();
}

// Refuses field `key` unless absent, null or equal to `want`.
void require_field(const nlohmann::json& j, const std::string& key, const nlohmann::json& want, const std::string& path,
                   const std::string& why) {
  if (!j.contains(key) || j.at(key).is_null() || j.at(key) == want) return;
  throw FileError(path, key + " " + shown(j.at(key)) + ": " + why);
}

// The rotary base: transformers 5's rope_parameters, else the older top-level
// rope_theta and rope_scaling; scaled or other kinds of rotary are refused.
double rope_theta_of(const nlohmann::json& j, const std::string& path) {
  if (j.contains("rope_scaling") && !j.at("rope_scaling").is_null()) {
    const auto& s = j.at("rope_scaling");
    const std::string type = s.is_object() ? s.value("rope_type", s.value("type", std::string("default"))) : "";
    if (type != "default") {
      throw FileError(path, "rope_scaling " + shown(s) +
                                ": composer's llama implements only the default rotary embedding (no scaling); "
                                "use a model without rope_scaling");
    }
  }
  double theta = float_field(j, "rope_theta", path, 10000.0);
  if (j.contains("rope_parameters") && !j.at("rope_parameters").is_null()) {
    const auto& r = j.at("rope_parameters");
    if (!r.is_object()) throw FileError(path, "rope_parameters " + shown(r) + ": expected an object");
    const std::string type = r.value("rope_type", std::string("default"));
    if (type != "default") {
      throw FileError(path, "rope_parameters.rope_type '" + type +
                                "': composer's llama implements only the default rotary embedding; use a model "
                                "whose rope_type is default");
    }
    for (const auto& [key, value] : r.items()) {
      if (key != "rope_type" && key != "rope_theta") {
        throw FileError(path, "rope_parameters." + key + " " + shown(value) +
                                  ": the default rotary embedding has no such parameter; remove it");
      }
    }
    theta = float_field(r, "rope_theta", path, theta);
  }
  return theta;
}

}  // namespace

void read_hf_llama_config(const std::string& dir, models::ModelArgs& args, bool keep_max_seq_len) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::is_directory(dir)) {
    throw FileError(dir, "not a folder; from_hf names a Hugging Face model folder (config.json and safetensors)");
  }
  std::ifstream in(path);
  if (!in) throw FileError(path, "cannot read it; a Hugging Face model folder has a config.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw FileError(path, "expected a JSON object");
  if (j.value("model_type", std::string()) != "llama") {
    throw FileError(path, "model_type " + (j.contains("model_type") ? shown(j.at("model_type")) : "missing") +
                              ": composer reads Llama models (model_type \"llama\") only");
  }
  if (j.contains("architectures") && j.at("architectures").is_array()) {
    for (const auto& a : j.at("architectures")) {
      if (a != "LlamaForCausalLM") {
        throw FileError(path, "architectures " + shown(j.at("architectures")) +
                                  ": composer's llama is LlamaForCausalLM (a causal language model head)");
      }
    }
  }
  require_field(j, "attention_bias", false, path, "composer's llama has no attention biases");
  require_field(j, "mlp_bias", false, path, "composer's llama has no MLP biases");
  require_field(j, "hidden_act", "silu", path, "composer's llama's feed-forward is SwiGLU (silu)");
  if (float_field(j, "attention_dropout", path, 0.0) != 0.0) {
    throw FileError(path, "attention_dropout " + shown(j.at("attention_dropout")) +
                              ": composer's llama applies no attention dropout; set it to 0.0");
  }
  for (const auto& [field, arg] : kIntFields) {
    if (std::string(arg) == "max_seq_len" && keep_max_seq_len) continue;
    const int64_t heads = args.i("n_heads");
    const int64_t value = int_field(j, field, path, std::string(arg) == "n_kv_heads" ? &heads : nullptr);
    if (value <= 0) throw FileError(path, std::string(field) + " " + std::to_string(value) + ": expected a positive integer");
    args.set(arg, value);
  }
  const int64_t head_dim = args.i("dim") / args.i("n_heads");
  if (j.contains("head_dim") && !j.at("head_dim").is_null() &&
      (!j.at("head_dim").is_number_integer() || j.at("head_dim").get<int64_t>() != head_dim ||
       args.i("dim") % args.i("n_heads") != 0)) {
    throw FileError(path, "head_dim " + shown(j.at("head_dim")) + ": composer's llama has head_dim = hidden_size / "
                              "num_attention_heads (" + std::to_string(head_dim) + ")");
  }
  args.set("norm_eps", float_field(j, "rms_norm_eps", path, 1e-6));
  args.set("rope_theta", rope_theta_of(j, path));
  if (j.contains("tie_word_embeddings") && !j.at("tie_word_embeddings").is_boolean()) {
    throw FileError(path, "tie_word_embeddings " + shown(j.at("tie_word_embeddings")) + ": expected true or false");
  }
  args.set("weight_tying", j.value("tie_word_embeddings", false));
}

nlohmann::ordered_json hf_llama_config(const models::ModelArgs& a, int64_t intermediate_size) {
  const int64_t kv = a.i("n_kv_heads") ? a.i("n_kv_heads") : a.i("n_heads");
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["dtype"] = "float32";
  j["head_dim"] = a.i("dim") / a.i("n_heads");
  j["hidden_act"] = "silu";
  for (const auto& [field, arg] : kIntFields) j[field] = a.i(arg);
  j["intermediate_size"] = intermediate_size;
  j["num_key_value_heads"] = kv;
  j["mlp_bias"] = false;
  j["rms_norm_eps"] = a.f("norm_eps");
  j["rope_parameters"] = {{"rope_theta", a.f("rope_theta")}, {"rope_type", "default"}};
  j["tie_word_embeddings"] = a.b("weight_tying");
  return j;
}

}  // namespace composer

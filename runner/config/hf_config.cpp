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
    throw FileError(path, "missing field '" + key + "' that a Llama or Mixtral config.json has");
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
// rope_theta and rope_scaling (`fallback` without either); scaled or other
// kinds of rotary are refused.
double rope_theta_of(const nlohmann::json& j, const std::string& path, double fallback) {
  if (j.contains("rope_scaling") && !j.at("rope_scaling").is_null()) {
    const auto& s = j.at("rope_scaling");
    const std::string type = s.is_object() ? s.value("rope_type", s.value("type", std::string("default"))) : "";
    if (type != "default") {
      throw FileError(path, "rope_scaling " + shown(s) +
                                ": composer's llama implements only the default rotary embedding (no scaling); "
                                "use a model without rope_scaling");
    }
  }
  double theta = float_field(j, "rope_theta", path, fallback);
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

// What a Mixtral config.json adds to a Llama one: its experts, and what
// composer's routed feed-forward does not compute, refused.
void read_mixtral_fields(const nlohmann::json& j, const std::string& path, models::ModelArgs& args) {
  const char* experts_key =
      j.contains("num_local_experts") || !j.contains("num_experts") ? "num_local_experts" : "num_experts";
  const int64_t experts = int_field(j, experts_key, path, nullptr);
  const int64_t top_k = int_field(j, "num_experts_per_tok", path, nullptr);
  if (experts <= 0)
    throw FileError(path, std::string(experts_key) + " " + std::to_string(experts) + ": expected a positive integer");
  if (top_k < 1 || top_k > experts) {
    throw FileError(path, "num_experts_per_tok " + std::to_string(top_k) + ": expected between 1 and " + experts_key +
                              " " + std::to_string(experts));
  }
  if (float_field(j, "router_jitter_noise", path, 0.0) != 0.0) {
    throw FileError(path, "router_jitter_noise " + shown(j.at("router_jitter_noise")) +
                              ": composer's router scales no hidden states by random noise in training; set it "
                              "to 0.0");
  }
  if (j.contains("output_router_logits") && !j.at("output_router_logits").is_null()) {
    const auto& v = j.at("output_router_logits");
    if (!v.is_boolean()) throw FileError(path, "output_router_logits " + shown(v) + ": expected true or false");
    if (v.get<bool>()) {
      throw FileError(path,
                      "output_router_logits true: transformers then adds router_aux_loss_coef times the "
                      "load-balancing loss to the loss, which composer does not compute; set it to false");
    }
  }
  // Mixtral's attention masks keys sliding_window or more positions back: the
  // same as causal when no sequence is that long.
  if (j.contains("sliding_window") && !j.at("sliding_window").is_null()) {
    const auto& v = j.at("sliding_window");
    if (!v.is_number_integer() || v.get<int64_t>() < args.i("max_seq_len")) {
      throw FileError(path, "sliding_window " + shown(v) +
                                ": composer's attention is causal over the whole sequence, which equals a sliding "
                                "window only as long as max_seq_len (" +
                                std::to_string(args.i("max_seq_len")) +
                                "); set sliding_window to null, or model.args.max_seq_len to at most it");
    }
  }
  args.set("n_experts", experts);
  args.set("top_k", top_k);
  args.set("moe_hidden_dim", args.i("hidden_dim"));
  args.set("n_shared_experts", int64_t{0});
  args.set("score_func", std::string("softmax"));
  args.set("route_norm", true);
  args.set("route_scale", 1.0);
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
  const std::string type = j.value("model_type", std::string());
  if (type != "llama" && type != "mixtral") {
    throw FileError(path, "model_type " + (j.contains("model_type") ? shown(j.at("model_type")) : "missing") +
                              ": composer reads Llama and Mixtral models (model_type \"llama\" or \"mixtral\") only");
  }
  const bool mixtral = type == "mixtral";
  const std::string arch = mixtral ? "MixtralForCausalLM" : "LlamaForCausalLM";
  if (j.contains("architectures") && j.at("architectures").is_array()) {
    for (const auto& a : j.at("architectures")) {
      if (a != arch) {
        throw FileError(path, "architectures " + shown(j.at("architectures")) + ": composer reads model_type \"" +
                                  type + "\" as " + arch + " (a causal language model head)");
      }
    }
  }
  if (!mixtral) {  // Mixtral's attention and experts have no biases to switch on
    require_field(j, "attention_bias", false, path, "composer's llama has no attention biases");
    require_field(j, "mlp_bias", false, path, "composer's llama has no MLP biases");
  }
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
  // transformers' defaults where the file leaves them out differ between the two.
  args.set("norm_eps", float_field(j, "rms_norm_eps", path, mixtral ? 1e-5 : 1e-6));
  args.set("rope_theta", rope_theta_of(j, path, mixtral ? 1e6 : 1e4));
  if (j.contains("tie_word_embeddings") && !j.at("tie_word_embeddings").is_boolean()) {
    throw FileError(path, "tie_word_embeddings " + shown(j.at("tie_word_embeddings")) + ": expected true or false");
  }
  args.set("weight_tying", j.value("tie_word_embeddings", false));
  if (mixtral) read_mixtral_fields(j, path, args);
}

void check_hf_exportable(const models::ModelArgs& a) {
  if (a.i("n_experts") == 0) return;
  auto refuse = [](const std::string& what) {
    throw UserError(
        "composer export --format hf writes a mixture-of-experts llama as Mixtral "
        "(MixtralForCausalLM: softmax router, top-k weights divided by their sum, no shared experts); "
        "this model has " +
        what + ", which Mixtral does not compute; use --format pt");
  };
  if (a.s("score_func") != "softmax") refuse("score_func " + a.s("score_func"));
  if (!a.b("route_norm")) refuse("route_norm false");
  if (a.f("route_scale") != 1.0) refuse("route_scale " + shown(a.f("route_scale")));
  if (a.i("n_shared_experts") != 0) refuse("n_shared_experts " + std::to_string(a.i("n_shared_experts")));
  // Mixtral is dropless and routes by the scores alone (the load-balancing
  // loss only trains; its forward is the same).
  if (a.f("capacity_factor") != 0) refuse("capacity_factor " + shown(a.f("capacity_factor")));
  if (a.f("bias_update_rate") != 0) refuse("an expert bias (bias_update_rate " + shown(a.f("bias_update_rate")) + ")");
}

nlohmann::ordered_json hf_llama_config(const models::ModelArgs& a, int64_t intermediate_size) {
  const int64_t kv = a.i("n_kv_heads") ? a.i("n_kv_heads") : a.i("n_heads");
  const bool mixtral = a.i("n_experts") > 0;
  nlohmann::ordered_json j;
  j["architectures"] = {mixtral ? "MixtralForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = mixtral ? "mixtral" : "llama";
  if (!mixtral) j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["dtype"] = "float32";
  j["head_dim"] = a.i("dim") / a.i("n_heads");
  j["hidden_act"] = "silu";
  for (const auto& [field, arg] : kIntFields) j[field] = a.i(arg);
  j["intermediate_size"] = intermediate_size;
  j["num_key_value_heads"] = kv;
  if (mixtral) {
    j["num_local_experts"] = a.i("n_experts");
    j["num_experts_per_tok"] = a.i("top_k");
    j["output_router_logits"] = false;
    j["router_aux_loss_coef"] = 0.001;  // transformers' default; used only with output_router_logits
    j["router_jitter_noise"] = 0.0;
    j["sliding_window"] = nullptr;
  } else {
    j["mlp_bias"] = false;
  }
  j["rms_norm_eps"] = a.f("norm_eps");
  j["rope_parameters"] = {{"rope_theta", a.f("rope_theta")}, {"rope_type", "default"}};
  j["tie_word_embeddings"] = a.b("weight_tying");
  return j;
}

}  // namespace composer

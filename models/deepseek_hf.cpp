// The Hugging Face adapter of model deepseek_v3: DeepseekV3ForCausalLM
// folders (model_type deepseek_v3: DeepSeek-V3, R1 and the models that share
// their architecture).
//
// Names (prefix model.layers.N.): self_attn.q_proj, or q_a_proj,
// q_a_layernorm and q_b_proj, are attention.wq, or wq_a, q_norm and wq_b;
// kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and o_proj are attention.wkv_a,
// kv_norm, wkv_b and wo. A dense layer's mlp.{gate,down,up}_proj are
// feed_forward.w{1,2,3}; a routed layer's mlp.gate.weight is the router,
// mlp.gate.e_score_correction_bias the expert bias, mlp.shared_experts.* the
// shared experts' SwiGLU and mlp.experts.J.{gate,down,up}_proj.weight slice J
// of the stacked feed_forward.experts.w{1,2,3}.
//
// Rotary: with rope_interleave true (the released models' and transformers'
// default) the rotated dims of q_b_proj's heads and of kv_a_proj_with_mqa are
// stored in interleaved pairs already, composer's layout: no row is permuted.
//
// The multi-token prediction layer (model.layers.<num_hidden_layers>.*, with
// num_nextn_predict_layers 1) is trained by neither transformers nor
// composer: its tensors are skipped, and an export has none
// (num_nextn_predict_layers 0).
#include <algorithm>

#include "models/hf_adapter.h"
#include "models/rope.h"

namespace composer::models {

bool llama_routed_layer(const ModelArgs& a, int64_t layer);  // llama.cpp

namespace {

using NamePairs = std::vector<std::pair<std::string, std::string>>;  // (Hugging Face, composer) within a layer
const NamePairs kLayerNames = {
    {"input_layernorm.weight", "attention_norm.weight"},
    {"self_attn.q_proj.weight", "attention.wq.weight"},
    {"self_attn.q_a_proj.weight", "attention.wq_a.weight"},
    {"self_attn.q_a_layernorm.weight", "attention.q_norm.weight"},
    {"self_attn.q_b_proj.weight", "attention.wq_b.weight"},
    {"self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"},
    {"self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"},
    {"self_attn.kv_b_proj.weight", "attention.wkv_b.weight"},
    {"self_attn.o_proj.weight", "attention.wo.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"}};
// A dense layer's feed-forward, and a routed layer's router, bias, shared and routed experts.
const NamePairs kDenseNames = {{"mlp.gate_proj.weight", "feed_forward.w1.weight"},
                               {"mlp.down_proj.weight", "feed_forward.w2.weight"},
                               {"mlp.up_proj.weight", "feed_forward.w3.weight"}};
const NamePairs kRoutedNames = {{"mlp.gate.weight", "feed_forward.router.weight"},
                                {"mlp.gate.e_score_correction_bias", "feed_forward.expert_bias"},
                                {"mlp.shared_experts.gate_proj.weight", "feed_forward.shared.w1.weight"},
                                {"mlp.shared_experts.down_proj.weight", "feed_forward.shared.w2.weight"},
                                {"mlp.shared_experts.up_proj.weight", "feed_forward.shared.w3.weight"}};
const hf::ExpertNames kExperts = {"mlp.experts.", {"gate_proj", "down_proj", "up_proj"}};

// `rest`, a name within a layer, on the other side (Hugging Face's when `to_hf`): the attention's
// and norms', then the feed-forward's of a dense or a routed layer; "" for none of them.
std::string in_layer(const std::string& rest, bool routed, bool to_hf) {
  for (const NamePairs* table : {&kLayerNames, routed ? &kRoutedNames : &kDenseNames}) {
    for (const auto& [h, c] : *table) {
      if (rest == (to_hf ? c : h)) return to_hf ? h : c;
    }
  }
  return "";
}

// config.json's integer fields and the arguments they give.
const std::pair<const char*, const char*> kIntFields[] = {{"hidden_size", "dim"},
                                                          {"intermediate_size", "hidden_dim"},
                                                          {"num_hidden_layers", "n_layers"},
                                                          {"num_attention_heads", "n_heads"},
                                                          {"vocab_size", "vocab_size"},
                                                          {"max_position_embeddings", "max_seq_len"},
                                                          {"kv_lora_rank", "kv_lora_rank"},
                                                          {"qk_nope_head_dim", "qk_nope_head_dim"},
                                                          {"qk_rope_head_dim", "qk_rope_head_dim"},
                                                          {"v_head_dim", "v_head_dim"},
                                                          {"n_routed_experts", "n_experts"},
                                                          {"num_experts_per_tok", "top_k"},
                                                          {"moe_intermediate_size", "moe_hidden_dim"},
                                                          {"n_group", "n_group"},
                                                          {"topk_group", "topk_group"}};
const char* const kWhat = "a DeepSeek-V3 config.json";

// What composer's deepseek_v3 does not compute, refused by field.
void refuse_unsupported(const nlohmann::json& j) {
  hf::require_architecture(j, "DeepseekV3ForCausalLM");
  hf::require_field(j, "scoring_func", "sigmoid", "composer's deepseek_v3 scores experts by a sigmoid (as transformers does)");
  hf::require_field(j, "topk_method", "noaux_tc",
                    "composer's deepseek_v3 routes as noaux_tc (group-limited, by score plus e_score_correction_bias)");
  hf::require_field(j, "rope_interleave", true,
                    "composer reads DeepSeek-V3's rotary dims in interleaved pairs (rope_interleave true, the "
                    "released models'); a half-split layout is not supported");
  hf::require_field(j, "attention_bias", false, "composer's deepseek_v3 has no attention biases");
  hf::require_field(j, "hidden_act", "silu", "composer's deepseek_v3's feed-forward is SwiGLU (silu)");
  hf::require_field(j, "pretraining_tp", 1, "composer computes each projection whole; set it to 1");
  if (hf::float_field(j, "attention_dropout", 0.0) != 0.0) {
    throw HfError("attention_dropout " + hf::shown(j.at("attention_dropout")) +
                  ": composer's deepseek_v3 applies no attention dropout; set it to 0.0");
  }
  if (hf::given(j, "quantization_config")) {
    throw HfError("quantization_config " + hf::shown(j.at("quantization_config")) +
                  ": composer reads floating-point weights only; dequantize the folder (its weight_scale_inv "
                  "tensors) to bfloat16 first");
  }
  const int64_t none = 0;
  if (hf::int_field(j, "num_nextn_predict_layers", &none, kWhat) > 1) {
    throw HfError("num_nextn_predict_layers " + hf::shown(j.at("num_nextn_predict_layers")) +
                  ": composer skips one multi-token prediction layer (which it does not train, as transformers "
                  "does not); a folder with more is not supported");
  }
  if (hf::given(j, "num_key_value_heads") && j.at("num_key_value_heads") != j.value("num_attention_heads", 0)) {
    throw HfError("num_key_value_heads " + hf::shown(j.at("num_key_value_heads")) +
                  ": DeepSeek-V3's latent attention expands a key and a value for every head; set it to "
                  "num_attention_heads");
  }
}

class DeepseekV3Hf final : public HfAdapter {
 public:
  std::vector<std::string> model_types() const override { return {"deepseek_v3"}; }
  std::vector<std::string> yaml_args() const override { return {"max_seq_len"}; }

  void read_config(const nlohmann::json& j, ModelArgs& args, const std::vector<std::string>& given) const override {
    refuse_unsupported(j);
    for (const auto& [field, arg] : kIntFields) {
      if (std::find(given.begin(), given.end(), arg) != given.end()) continue;
      const int64_t one = 1;
      const bool groups = std::string(arg) == "n_group" || std::string(arg) == "topk_group";
      args.set(arg, hf::positive_field(j, field, groups ? &one : nullptr, kWhat));
    }
    const int64_t none = 0;
    args.set("q_lora_rank", hf::given(j, "q_lora_rank") ? hf::positive_field(j, "q_lora_rank", nullptr, kWhat) : none);
    args.set("n_shared_experts", hf::int_field(j, "n_shared_experts", &none, kWhat));
    args.set("n_dense_layers", hf::int_field(j, "first_k_dense_replace", &none, kWhat));
    args.set("norm_eps", hf::float_field(j, "rms_norm_eps", 1e-6));
    hf::read_rope(j, 1e4, args);
    args.set("weight_tying", hf::bool_field(j, "tie_word_embeddings", false));
    args.set("score_func", std::string("sigmoid"));
    args.set("route_norm", hf::bool_field(j, "norm_topk_prob", true));
    args.set("route_scale", hf::float_field(j, "routed_scaling_factor", 1.0));
    args.set("expert_bias", true);  // e_score_correction_bias, which transformers never updates
  }

  void check_export(const ModelArgs& a) const override {
    auto refuse = [](const std::string& what) {
      throw HfError("composer export --format hf writes model deepseek_v3 as DeepSeek-V3 (DeepseekV3ForCausalLM: "
                    "sigmoid routing with an e_score_correction_bias, shared experts, every layer past "
                    "first_k_dense_replace routed, dropless); this model has " + what +
                    ", which DeepSeek-V3 does not compute; use --format pt");
    };
    if (a.i("n_experts") == 0) refuse("n_experts 0");
    if (a.s("score_func") != "sigmoid") refuse("score_func " + a.s("score_func"));
    if (a.i("moe_layer_step") != 1) refuse("moe_layer_step " + std::to_string(a.i("moe_layer_step")));
    if (!a.s("dense_layers").empty()) refuse("dense_layers \"" + a.s("dense_layers") + "\"");
    if (a.i("n_shared_experts") < 1) refuse("n_shared_experts 0");
    if (!a.b("expert_bias") && a.f("bias_update_rate") == 0) refuse("no expert bias (set expert_bias: true)");
    if (a.f("capacity_factor") != 0) refuse("capacity_factor " + hf::shown(a.f("capacity_factor")));
  }

  nlohmann::ordered_json write_config(const ModelArgs& a, const ShapeOf& shape) const override {
    int64_t first_routed = -1;
    for (int64_t i = a.i("n_layers") - 1; i >= 0; --i) {
      if (llama_routed_layer(a, i)) first_routed = i;
    }
    const int64_t expert_width = shape("layers." + std::to_string(first_routed) + ".feed_forward.experts.w1").at(1);
    // A dense layer's width, else the width given (transformers builds no dense layer then).
    const int64_t dense_width = a.i("n_dense_layers") > 0 ? shape("layers.0.feed_forward.w1.weight").at(0)
                                : a.i("hidden_dim") > 0   ? a.i("hidden_dim")
                                                          : expert_width;
    nlohmann::ordered_json j;
    j["architectures"] = {"DeepseekV3ForCausalLM"};
    j["model_type"] = "deepseek_v3";
    j["attention_bias"] = false;
    j["attention_dropout"] = 0.0;
    j["dtype"] = "float32";
    j["first_k_dense_replace"] = a.i("n_dense_layers");
    j["hidden_act"] = "silu";
    for (const auto& [field, arg] : kIntFields) j[field] = a.i(arg);
    j["intermediate_size"] = dense_width;
    j["moe_intermediate_size"] = expert_width;
    j["num_key_value_heads"] = a.i("n_heads");
    j["q_lora_rank"] = a.i("q_lora_rank") > 0 ? nlohmann::ordered_json(a.i("q_lora_rank")) : nlohmann::ordered_json();
    j["n_shared_experts"] = a.i("n_shared_experts");
    j["norm_topk_prob"] = a.b("route_norm");
    j["routed_scaling_factor"] = a.f("route_scale");
    j["num_nextn_predict_layers"] = 0;
    j["rms_norm_eps"] = a.f("norm_eps");
    j["rope_interleave"] = true;
    j["rope_parameters"] = hf::rope_json(a);
    j["tie_word_embeddings"] = a.b("weight_tying");
    return j;
  }

  std::string hf_name(const std::string& name, const ModelArgs& a, int64_t expert) const override {
    return hf::renamed(name, false, [&](int64_t layer, const std::string& rest) {
      const bool routed = llama_routed_layer(a, layer);
      const std::string other = in_layer(rest, routed, /*to_hf=*/true);
      return other.empty() && routed ? hf::expert_hf_name(rest, kExperts, expert) : other;
    });
  }

  std::string name_of(const std::string& hf, const ModelArgs& a, int64_t* expert) const override {
    if (expert) *expert = -1;
    return hf::renamed(hf, true, [&](int64_t layer, const std::string& rest) {
      const bool routed = llama_routed_layer(a, layer);
      const std::string other = in_layer(rest, routed, /*to_hf=*/false);
      return other.empty() && routed ? hf::expert_name_of(rest, kExperts, expert) : other;
    });
  }

  bool per_expert(const std::string& name, const ModelArgs&) const override { return hf::stacked_expert(name); }

  // The multi-token prediction layer, stored after the decoder's (the one the released models have,
  // which transformers skips too); a folder with more layers is refused by their count.
  bool ignored(const std::string& hf, const ModelArgs& a) const override {
    return hf.rfind("model.layers." + std::to_string(a.i("n_layers")) + ".", 0) == 0;
  }
};

}  // namespace

std::shared_ptr<const HfAdapter> deepseek_v3_hf_adapter() { return std::make_shared<DeepseekV3Hf>(); }

}  // namespace composer::models

// The decoder's Hugging Face adapters: for model llama, LlamaForCausalLM
// folders (model_type llama) for a dense llama and MixtralForCausalLM
// (mixtral) for a mixture of experts; for model qwen3, Qwen3ForCausalLM
// (qwen3) and Qwen3MoeForCausalLM (qwen3_moe, its experts named
// mlp.experts.J.{gate,down,up}_proj and its router mlp.gate).
//
// Names: model.layers.N.self_attn.q_proj.weight is layers.N.attention.wq.weight
// and so on (kLayerNames); Mixtral's block_sparse_moe.gate is the router, and
// its block_sparse_moe.experts.J.w{1,2,3}.weight is slice J of the stacked
// feed_forward.experts.w{1,2,3}.
//
// Rotary: Hugging Face rotates the two halves of each head's dimensions
// (rotate_half); composer's llama, like torchtitan and Meta's code, rotates
// interleaved pairs. Each head's rows of wq and wk are permuted between the
// two; wv, wo and the rest are the same matrices.
//
// config.json: hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads, num_key_value_heads, rms_norm_eps, vocab_size,
// max_position_embeddings, tie_word_embeddings and the rotary base (top-level
// rope_theta or transformers 5's rope_parameters, with llama3 or yarn scaling:
// models/rope.h). What llama cannot compute exactly is refused by field:
// another architecture, another rope_type, biases, a
// head_dim other than hidden_size / num_attention_heads, another activation,
// attention dropout; for Mixtral router_jitter_noise, output_router_logits
// true (the load-balancing loss joins the loss) and a sliding_window shorter
// than max_seq_len.
#include <algorithm>

#include "models/hf_adapter.h"
#include "models/rope.h"

namespace composer::models {

bool llama_routed_layer(const ModelArgs& a, int64_t layer);  // llama.cpp

namespace {

// Hugging Face's per-layer names and composer llama's.
const std::pair<const char*, const char*> kLayerNames[] = {
    {"input_layernorm.weight", "attention_norm.weight"},
    {"self_attn.q_proj.weight", "attention.wq.weight"},
    {"self_attn.k_proj.weight", "attention.wk.weight"},
    {"self_attn.v_proj.weight", "attention.wv.weight"},
    {"self_attn.o_proj.weight", "attention.wo.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate_proj.weight", "feed_forward.w1.weight"},
    {"mlp.down_proj.weight", "feed_forward.w2.weight"},
    {"mlp.up_proj.weight", "feed_forward.w3.weight"},
    {"self_attn.q_norm.weight", "attention.q_norm.weight"},  // Qwen3's
    {"self_attn.k_norm.weight", "attention.k_norm.weight"}};
// A mixture-of-experts family's names: the router, and its experts'.
struct ExpertNames {
  const char* router;
  hf::ExpertNames experts;
};
const ExpertNames kMixtralExperts = {"block_sparse_moe.gate.weight", {"block_sparse_moe.experts.", {"w1", "w2", "w3"}}};
const ExpertNames kQwen3MoeExperts = {"mlp.gate.weight", {"mlp.experts.", {"gate_proj", "down_proj", "up_proj"}}};
// config.json's integer fields and the llama arguments they give.
const std::pair<const char*, const char*> kIntFields[] = {{"hidden_size", "dim"},
                                                          {"intermediate_size", "hidden_dim"},
                                                          {"num_hidden_layers", "n_layers"},
                                                          {"num_attention_heads", "n_heads"},
                                                          {"num_key_value_heads", "n_kv_heads"},
                                                          {"vocab_size", "vocab_size"},
                                                          {"max_position_embeddings", "max_seq_len"}};
const char* const kWhat = "a Llama, Mixtral or Qwen3 config.json";

bool moe(const ModelArgs& a) { return a.i("n_experts") > 0; }
// Key/value heads: n_kv_heads, 0 meaning n_heads.
int64_t kv_heads(const ModelArgs& a) { return a.i("n_kv_heads") ? a.i("n_kv_heads") : a.i("n_heads"); }

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The expert count (under `key`, or its alias `other` when only that is
// given) and num_experts_per_tok, set as n_experts and top_k.
void read_expert_counts(const nlohmann::json& j, const char* key, const char* other, ModelArgs& args) {
  const char* experts_key = j.contains(key) || !j.contains(other) ? key : other;
  const int64_t experts = hf::positive_field(j, experts_key, nullptr, kWhat);
  const int64_t top_k = hf::int_field(j, "num_experts_per_tok", nullptr, kWhat);
  if (top_k < 1 || top_k > experts) {
    throw HfError("num_experts_per_tok " + std::to_string(top_k) + ": expected between 1 and " + experts_key + " " +
                  std::to_string(experts));
  }
  args.set("n_experts", experts);
  args.set("top_k", top_k);
}

// What a Mixtral config.json adds to a Llama one: its experts, and what
// composer's routed feed-forward does not compute, refused.
void read_mixtral_fields(const nlohmann::json& j, ModelArgs& args) {
  read_expert_counts(j, "num_local_experts", "num_experts", args);
  if (hf::float_field(j, "router_jitter_noise", 0.0) != 0.0) {
    throw HfError("router_jitter_noise " + hf::shown(j.at("router_jitter_noise")) +
                  ": composer's router scales no hidden states by random noise in training; set it to 0.0");
  }
  if (hf::bool_field(j, "output_router_logits", false)) {
    throw HfError(
        "output_router_logits true: transformers then adds router_aux_loss_coef times the load-balancing loss to "
        "the loss, which composer does not compute; set it to false");
  }
  // Mixtral's attention masks keys sliding_window or more positions back: the
  // same as causal when no sequence is that long.
  if (hf::given(j, "sliding_window")) {
    const auto& v = j.at("sliding_window");
    if (!v.is_number_integer() || v.get<int64_t>() < args.i("max_seq_len")) {
      throw HfError("sliding_window " + hf::shown(v) +
                    ": composer's attention is causal over the whole sequence, which equals a sliding window only "
                    "as long as max_seq_len (" +
                    std::to_string(args.i("max_seq_len")) +
                    "); set sliding_window to null, or model.args.max_seq_len to at most it");
    }
  }
  args.set("moe_hidden_dim", args.i("hidden_dim"));
  args.set("n_shared_experts", int64_t{0});
  args.set("score_func", std::string("softmax"));
  args.set("route_norm", true);
  args.set("route_scale", 1.0);
}

// Qwen3's attention: causal over the whole sequence (no sliding window).
void refuse_qwen3_window(const nlohmann::json& j) {
  if (hf::bool_field(j, "use_sliding_window", false)) {
    throw HfError("use_sliding_window true: composer's attention is causal over the whole sequence, with no "
                  "sliding window; set it to false");
  }
  if (hf::given(j, "layer_types")) {
    for (const auto& t : j.at("layer_types")) {
      if (t != "full_attention") {
        throw HfError("layer_types " + hf::shown(j.at("layer_types")) + ": layer type " + hf::shown(t) +
                      " is not full_attention, the only attention composer computes; use full_attention");
      }
    }
  }
}

// mlp_only_layers (the layers with a dense feed-forward) as the dense_layers argument: "0, 2".
std::string dense_layers_of(const nlohmann::json& j) {
  const auto& list = j.at("mlp_only_layers");
  const int64_t layers = hf::positive_field(j, "num_hidden_layers", nullptr, kWhat);
  std::string out;
  for (const auto& v : list.is_array() ? list : nlohmann::json::array({list})) {
    if (!list.is_array() || !v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= layers ||
        std::count(list.begin(), list.end(), v) > 1) {
      throw HfError("mlp_only_layers " + hf::shown(list) + ": " + hf::shown(v) +
                    " is not a layer index from 0 to num_hidden_layers - 1 (" + std::to_string(layers - 1) +
                    ") listed once; list each dense layer's index once, e.g. [0, 2], or [] for none");
    }
    out += (out.empty() ? "" : ", ") + std::to_string(v.get<int64_t>());
  }
  return out;
}

// What a Qwen3-MoE config.json adds to a Qwen3 one: its experts (every
// layer's, softmax-routed, no shared experts), and what composer does not
// compute, refused.
void read_qwen3_moe_fields(const nlohmann::json& j, ModelArgs& args) {
  read_expert_counts(j, "num_experts", "num_local_experts", args);
  const int64_t one = 1;
  args.set("moe_layer_step", hf::positive_field(j, "decoder_sparse_step", &one, kWhat));
  if (hf::given(j, "mlp_only_layers")) args.set("dense_layers", dense_layers_of(j));
  if (hf::bool_field(j, "output_router_logits", false)) {
    throw HfError(
        "output_router_logits true: transformers then adds router_aux_loss_coef times the load-balancing loss to "
        "the loss, which composer does not compute; set it to false");
  }
  args.set("moe_hidden_dim", hf::positive_field(j, "moe_intermediate_size", nullptr, kWhat));
  args.set("n_shared_experts", int64_t{0});
  args.set("score_func", std::string("softmax"));
  args.set("route_norm", hf::bool_field(j, "norm_topk_prob", false));
  args.set("route_scale", 1.0);
}

// What llama has that neither Llama's nor Mixtral's folders switch on, refused.
void refuse_unsupported(const nlohmann::json& j, bool mixtral, bool qwen3) {
  const bool qwen3_moe = j.value("model_type", std::string()) == "qwen3_moe";
  hf::require_architecture(j, qwen3_moe ? "Qwen3MoeForCausalLM"
                              : qwen3   ? "Qwen3ForCausalLM"
                              : mixtral ? "MixtralForCausalLM"
                                        : "LlamaForCausalLM");
  if (qwen3) refuse_qwen3_window(j);
  if (!mixtral) {  // Mixtral's attention and experts have no biases to switch on
    hf::require_field(j, "attention_bias", false, "composer's llama has no attention biases");
    hf::require_field(j, "mlp_bias", false, "composer's llama has no MLP biases");
  }
  hf::require_field(j, "hidden_act", "silu", "composer's llama's feed-forward is SwiGLU (silu)");
  if (hf::float_field(j, "attention_dropout", 0.0) != 0.0) {
    throw HfError("attention_dropout " + hf::shown(j.at("attention_dropout")) +
                  ": composer's llama applies no attention dropout; set it to 0.0");
  }
}

// Llama and Mixtral folders for model llama; Qwen3 folders (the same
// decoder with q and k norms and its own head_dim) for model qwen3.
class LlamaHf final : public HfAdapter {
 public:
  explicit LlamaHf(bool qwen3) : qwen3_(qwen3) {}
  std::vector<std::string> model_types() const override {
    return qwen3_ ? std::vector<std::string>{"qwen3", "qwen3_moe"} : std::vector<std::string>{"llama", "mixtral"};
  }
  std::vector<std::string> yaml_args() const override { return {"max_seq_len"}; }

  void read_config(const nlohmann::json& j, ModelArgs& args, const std::vector<std::string>& given) const override {
    const bool mixtral = j.value("model_type", std::string()) == "mixtral";
    refuse_unsupported(j, mixtral, qwen3_);
    for (const auto& [field, arg] : kIntFields) {
      if (std::find(given.begin(), given.end(), arg) != given.end()) continue;
      const int64_t heads = args.i("n_heads");
      args.set(arg, hf::positive_field(j, field, std::string(arg) == "n_kv_heads" ? &heads : nullptr, kWhat));
    }
    const int64_t head_dim = args.i("dim") / args.i("n_heads");
    if (qwen3_) {  // its own head width: q_proj is [heads x head_dim, hidden]
      const int64_t derived = head_dim;
      args.set("head_dim", hf::positive_field(j, "head_dim", &derived, kWhat));
    } else if (hf::given(j, "head_dim") &&
        (!j.at("head_dim").is_number_integer() || j.at("head_dim").get<int64_t>() != head_dim ||
         args.i("dim") % args.i("n_heads") != 0)) {
      throw HfError("head_dim " + hf::shown(j.at("head_dim")) +
                    ": composer's llama has head_dim = hidden_size / num_attention_heads (" +
                    std::to_string(head_dim) + ")");
    }
    // transformers' defaults where the file leaves them out differ between the two.
    args.set("norm_eps", hf::float_field(j, "rms_norm_eps", mixtral ? 1e-5 : 1e-6));
    args.set("qk_norm", qwen3_);
    hf::read_rope(j, mixtral ? 1e6 : 1e4, args);
    args.set("weight_tying", hf::bool_field(j, "tie_word_embeddings", false));
    if (mixtral) read_mixtral_fields(j, args);
    if (j.value("model_type", std::string()) == "qwen3_moe") read_qwen3_moe_fields(j, args);
  }

  void check_export(const ModelArgs& a) const override {
    if (!qwen3_ && (a.b("qk_norm") || (a.i("head_dim") != 0 && a.i("head_dim") != a.i("dim") / a.i("n_heads")))) {
      throw HfError("Llama (LlamaForCausalLM) has no q and k norms and a head_dim of hidden_size / "
                    "num_attention_heads; this llama has qk_norm " + std::string(a.b("qk_norm") ? "true" : "false") +
                    " and head_dim " + std::to_string(a.i("head_dim")) + "; train it as model qwen3, or use --format pt");
    }
    if (qwen3_ && !a.b("qk_norm")) {
      throw HfError("Qwen3 (Qwen3ForCausalLM) normalises each query and key head; this qwen3 has qk_norm false; "
                    "use --format pt");
    }
    if (!moe(a)) return;
    auto refuse = [this](const std::string& what) {
      throw HfError(qwen3_ ? "composer export --format hf writes a mixture-of-experts qwen3 as Qwen3-MoE "
                             "(Qwen3MoeForCausalLM: softmax router, top-k weights divided by their sum or not, no "
                             "shared experts); this model has " + what + ", which Qwen3-MoE does not compute; use "
                             "--format pt"
                           : "composer export --format hf writes a mixture-of-experts llama as Mixtral "
                             "(MixtralForCausalLM: softmax router, top-k weights divided by their sum, no shared "
                             "experts); this model has " + what + ", which Mixtral does not compute; use --format pt");
    };
    if (a.s("score_func") != "softmax") refuse("score_func " + a.s("score_func"));
    if (a.i("n_dense_layers") != 0) refuse("n_dense_layers " + std::to_string(a.i("n_dense_layers")));
    if (!qwen3_ && a.i("moe_layer_step") != 1) refuse("moe_layer_step " + std::to_string(a.i("moe_layer_step")));
    if (!qwen3_ && !a.s("dense_layers").empty()) refuse("dense_layers \"" + a.s("dense_layers") + "\"");
    if (!qwen3_ && !a.b("route_norm")) refuse("route_norm false");
    if (a.f("route_scale") != 1.0) refuse("route_scale " + hf::shown(a.f("route_scale")));
    if (a.i("n_shared_experts") != 0) refuse("n_shared_experts " + std::to_string(a.i("n_shared_experts")));
    // Mixtral is dropless and routes by the scores alone (the load-balancing
    // loss only trains; its forward is the same).
    if (a.f("capacity_factor") != 0) refuse("capacity_factor " + hf::shown(a.f("capacity_factor")));
    if (a.f("bias_update_rate") != 0) {
      refuse("an expert bias (bias_update_rate " + hf::shown(a.f("bias_update_rate")) + ")");
    }
  }

  nlohmann::ordered_json write_config(const ModelArgs& a, const ShapeOf& shape) const override {
    const bool routed = moe(a), mixtral = routed && !qwen3_, qwen3_moe = routed && qwen3_;
    // The widths llama may derive: an expert's (the first routed layer's), a dense layer's.
    int64_t first_routed = -1, first_dense = -1;
    for (int64_t i = a.i("n_layers") - 1; i >= 0; --i) (llama_routed_layer(a, i) ? first_routed : first_dense) = i;
    const std::string at = "layers." + std::to_string(routed ? first_routed : 0) + ".";
    const int64_t intermediate_size =
        routed ? shape(at + "feed_forward.experts.w1").at(1) : shape(at + "feed_forward.w1.weight").at(0);
    nlohmann::ordered_json j;
    j["architectures"] = {qwen3_moe ? "Qwen3MoeForCausalLM"
                          : qwen3_  ? "Qwen3ForCausalLM"
                          : mixtral ? "MixtralForCausalLM"
                                    : "LlamaForCausalLM"};
    j["model_type"] = qwen3_moe ? "qwen3_moe" : qwen3_ ? "qwen3" : mixtral ? "mixtral" : "llama";
    if (!mixtral) j["attention_bias"] = false;
    j["attention_dropout"] = 0.0;
    j["dtype"] = "float32";
    j["head_dim"] = a.i("head_dim") > 0 ? a.i("head_dim") : a.i("dim") / a.i("n_heads");
    j["hidden_act"] = "silu";
    for (const auto& [field, arg] : kIntFields) j[field] = a.i(arg);
    j["intermediate_size"] = intermediate_size;
    j["num_key_value_heads"] = kv_heads(a);
    if (mixtral) {
      j["num_local_experts"] = a.i("n_experts");
      j["num_experts_per_tok"] = a.i("top_k");
      j["output_router_logits"] = false;
      j["router_aux_loss_coef"] = 0.001;  // transformers' default; used only with output_router_logits
      j["router_jitter_noise"] = 0.0;
      j["sliding_window"] = nullptr;
    } else if (qwen3_) {
      if (qwen3_moe) {
        j["num_experts"] = a.i("n_experts");
        j["num_experts_per_tok"] = a.i("top_k");
        j["moe_intermediate_size"] = intermediate_size;
        j["norm_topk_prob"] = a.b("route_norm");
        j["decoder_sparse_step"] = a.i("moe_layer_step");
        // The dense layers' width (decoder_sparse_step > 1), else the dense width the model would derive.
        j["intermediate_size"] = first_dense >= 0
                                     ? shape("layers." + std::to_string(first_dense) + ".feed_forward.w1.weight").at(0)
                                     : (a.i("hidden_dim") > 0 ? a.i("hidden_dim") : intermediate_size);
        // The layers decoder_sparse_step routes that dense_layers keeps dense (n_dense_layers is refused).
        j["mlp_only_layers"] = nlohmann::ordered_json::array();
        for (int64_t i = 0; i < a.i("n_layers"); ++i) {
          if ((i + 1) % a.i("moe_layer_step") == 0 && !llama_routed_layer(a, i)) j["mlp_only_layers"].push_back(i);
        }
        j["output_router_logits"] = false;
        j["router_aux_loss_coef"] = 0.001;  // transformers' default; used only with output_router_logits
      }
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      j["max_window_layers"] = a.i("n_layers");
    } else {
      j["mlp_bias"] = false;
    }
    j["rms_norm_eps"] = a.f("norm_eps");
    j["rope_parameters"] = hf::rope_json(a);
    j["tie_word_embeddings"] = a.b("weight_tying");
    return j;
  }

  std::string hf_name(const std::string& name, const ModelArgs& a, int64_t expert) const override {
    return hf::renamed(name, false, [&](int64_t layer, const std::string& rest) -> std::string {
      const bool routed = llama_routed_layer(a, layer);
      for (const auto& [h, c] : kLayerNames) {
        if (rest == c && !(routed && rest.rfind("feed_forward.", 0) == 0)) return h;
      }
      if (!routed) return "";
      const ExpertNames& n = expert_names();
      if (rest == "feed_forward.router.weight") return n.router;
      return hf::expert_hf_name(rest, n.experts, expert);
    });
  }

  std::string name_of(const std::string& hf, const ModelArgs& a, int64_t* expert) const override {
    if (expert) *expert = -1;
    return hf::renamed(hf, true, [&](int64_t layer, const std::string& rest) -> std::string {
      const bool routed = llama_routed_layer(a, layer);
      for (const auto& [h, c] : kLayerNames) {
        if (routed && std::string(c).rfind("feed_forward.", 0) == 0) continue;  // an MoE block has no dense SwiGLU
        if (rest == h) return c;
      }
      if (!routed) return "";
      const ExpertNames& n = expert_names();
      if (rest == n.router) return "feed_forward.router.weight";
      return hf::expert_name_of(rest, n.experts, expert);
    });
  }

  bool per_expert(const std::string& name, const ModelArgs& a) const override {
    return moe(a) && hf::stacked_expert(name);
  }

  const ExpertNames& expert_names() const { return qwen3_ ? kQwen3MoeExperts : kMixtralExperts; }

  // Older folders kept the rotary tables as a buffer.
  bool ignored(const std::string& hf, const ModelArgs&) const override { return ends_with(hf, "rotary_emb.inv_freq"); }

  int64_t row_groups(const std::string& name, const ModelArgs& a) const override {
    if (ends_with(name, "attention.wq.weight")) return a.i("n_heads");
    if (ends_with(name, "attention.wk.weight")) return kv_heads(a);
    // One head's norm weight, shared by every head: its elements in the head's row order.
    if (ends_with(name, "attention.q_norm.weight") || ends_with(name, "attention.k_norm.weight")) return 1;
    return 0;
  }
  torch::Tensor to_hf_rows(const torch::Tensor& w, int64_t groups) const override {
    return rotary_pairs_to_halves(w, groups);
  }
  torch::Tensor from_hf_rows(const torch::Tensor& w, int64_t groups) const override {
    return rotary_halves_to_pairs(w, groups);
  }

 private:
  bool qwen3_;
};

}  // namespace

std::shared_ptr<const HfAdapter> llama_hf_adapter() { return std::make_shared<LlamaHf>(false); }
std::shared_ptr<const HfAdapter> qwen3_hf_adapter() { return std::make_shared<LlamaHf>(true); }

}  // namespace composer::models

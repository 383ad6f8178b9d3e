// Hugging Face Llama's and Mixtral's config.json and composer's llama
// arguments, both ways: model.from_hf reads one into the arguments, `composer
// export --format hf` writes one from them. Only what llama computes exactly is
// accepted.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

#include "models/model.h"

namespace composer {

// Sets llama's arguments from `dir`/config.json (hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, rms_norm_eps,
// vocab_size, max_position_embeddings, tie_word_embeddings and the rotary base,
// top-level rope_theta or transformers 5's rope_parameters). A model llama
// cannot represent exactly (another model_type or architecture, rope scaling,
// biases, a head_dim other than hidden_size / num_attention_heads, another
// activation, attention dropout) is a FileError naming the field and its
// value. `keep_max_seq_len`: the config gave max_seq_len, which then stays.
//
// A Mixtral folder (model_type mixtral) gives llama's mixture of experts as
// Mixtral routes: n_experts (num_local_experts), top_k (num_experts_per_tok),
// moe_hidden_dim (intermediate_size), softmax scores, route_norm, no shared
// experts. Refused: router_jitter_noise other than 0, output_router_logits
// true (the load-balancing loss joins the loss), a sliding_window shorter than
// max_seq_len.
void read_hf_llama_config(const std::string& dir, models::ModelArgs& args, bool keep_max_seq_len);

// Refuses (UserError) llama arguments that no Hugging Face folder composer
// writes computes: a mixture of experts other than Mixtral's.
void check_hf_exportable(const models::ModelArgs& args);

// The config.json of llama with `args` (and its feed-forward width, which
// llama may derive; an expert's, for a mixture of experts) as transformers'
// LlamaForCausalLM, or MixtralForCausalLM when args.n_experts > 0, reads it.
nlohmann::ordered_json hf_llama_config(const models::ModelArgs& args, int64_t intermediate_size);

}  // namespace composer

// Hugging Face Llama's config.json and composer's llama arguments, both ways:
// model.from_hf reads one into the arguments, `composer export --format hf`
// writes one from them. Only what llama computes exactly is accepted.
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
void read_hf_llama_config(const std::string& dir, models::ModelArgs& args, bool keep_max_seq_len);

// The config.json of llama with `args` (and its feed-forward width, which
// llama may derive) as transformers' LlamaForCausalLM reads it.
nlohmann::ordered_json hf_llama_config(const models::ModelArgs& args, int64_t intermediate_size);

}  // namespace composer

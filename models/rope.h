// Rotary position embeddings: the frequency table of each rope_type
// (default, llama3, yarn) as transformers' modeling_rope_utils computes it,
// the model arguments that choose one, and their config.json form
// (rope_parameters) for Hugging Face adapters. Models rotate with the
// table; the reference (tools/reference/models.py) computes the same.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <vector>

#include "models/model.h"
#include "models/sequence.h"

namespace composer::models {

// The arguments (rope_theta and the scaling ones) a model with rotary embeddings declares.
std::vector<ArgSpec> rope_args();
// Refuses a rope_type other than default, llama3 and yarn, a value out of
// range, and a scaling argument set for a rope_type that does not use it.
void check_rope_args(const ModelArgs& a);

// The rotary table of `dim` rotated dims per head: inv_freq (dim/2 float32
// frequencies) and the factor cos and sin are multiplied by (yarn's
// attention scaling; 1 otherwise).
struct RopeFrequencies {
  torch::Tensor inv_freq;
  double scaling = 1;
};
RopeFrequencies rope_frequencies(const ModelArgs& a, int64_t dim);
// cos and sin of every position below `positions` times each frequency, times the scaling.
std::pair<torch::Tensor, torch::Tensor> rope_tables(const ModelArgs& a, int64_t dim, int64_t positions);

// The factor by which a model whose attention scales its softmax with the
// rotary scaling (DeepSeek-V3's) multiplies head_dim^-0.5: yarn's
// mscale(rope_factor, rope_mscale_all_dim)^2 when rope_mscale_all_dim is set,
// 1 otherwise (transformers' DeepseekV3Attention.scaling).
double rope_softmax_scale(const ModelArgs& a);

// The rows of the tables `cos` and `sin` for this forward's `s` positions of
// `b` samples: the first s, or, under a context-parallel split or packed
// documents (`slot`), each token's position ((b, s, dim/2) per sample when
// documents restart them).
std::pair<torch::Tensor, torch::Tensor> rope_rows(nn::SequenceSlot& slot, const torch::Tensor& cos,
                                                  const torch::Tensor& sin, int64_t b, int64_t s,
                                                  const c10::Device& device);
// Rotates the interleaved pairs (dims 2i, 2i+1) of x (b, s, heads, dim) by
// the angles `cos` and `sin` (rope_rows'): the real form of torchtitan's
// complex multiply by freqs_cis. On a GPU as torchtitan computes it (a complex
// multiply); on the CPU in the real form, op for op the goldens'.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

namespace hf {
// Sets rope_theta and the scaling arguments from config.json: transformers 5's
// rope_parameters, or the older top-level rope_theta and rope_scaling
// ("type" or "rope_type"); `theta` when neither gives the base. Another
// rope_type, or a field of it composer does not compute, is an HfError.
void read_rope(const nlohmann::json& j, double theta, ModelArgs& args);
// rope_parameters for config.json.
nlohmann::ordered_json rope_json(const ModelArgs& args);
}  // namespace hf

}  // namespace composer::models

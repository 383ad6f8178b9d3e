// The building blocks of the seed models, with PyTorch's parameter names,
// default initialisation and math: Linear, Embedding, LayerNorm, RMSNorm and
// the parameter-free activations that PyTorch registers as modules.
#pragma once
#include "models/module.h"

namespace composer::nn {

class Linear : public Module {
 public:
  // `tied_weight`, when given, is registered as this layer's weight (weight tying).
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         torch::Tensor tied_weight = {});
  torch::Tensor forward(torch::Tensor x) override;
  torch::Tensor weight;
  torch::Tensor bias;  // undefined when bias=false
  int64_t in_features, out_features;
  // When true, forward leaves the bias out (a transform adds param(bias)
  // later, e.g. after a tensor-parallel reduction).
  bool bias_after = false;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim);
  torch::Tensor forward(torch::Tensor ids) override;
  torch::Tensor weight;
  int64_t num_embeddings, embedding_dim;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true);
  torch::Tensor forward(torch::Tensor x) override;
  torch::Tensor weight, bias;
  int64_t dim;
  double eps;
};

// x * rsqrt(mean(x^2) + eps) * weight, normalised in float32 (torchtitan's RMSNorm).
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6);
  torch::Tensor forward(torch::Tensor x) override;
  torch::Tensor weight;
  int64_t dim;
  double eps;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  torch::Tensor forward(torch::Tensor x) override { return torch::relu(x); }
};

// Truncated normal initialisation (PyTorch's nn.init.trunc_normal_), which
// LibTorch's C++ API lacks.
void trunc_normal_(torch::Tensor t, double mean, double std, double a, double b);

}  // namespace composer::nn

namespace composer::nn {
// softmax(q k^T / sqrt(head_dim) [+ causal mask]) v on (batch, heads, seq, head_dim),
// written from matmul, mask and softmax (LibTorch 1.13 has no fused SDPA).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        bool causal, double dropout_p, bool training);
}  // namespace composer::nn

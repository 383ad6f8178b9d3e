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

// Deferred weight gradients (the zero-bubble pipelines' W action). While a
// DeferWeightGrads scope is open on a thread, every Linear forward on that
// thread whose weight or bias requires grad computes through an autograd
// function whose backward returns only the input gradient and records the
// output gradient; the layer's input, weight and bias are recorded at forward.
// One ordinary backward therefore yields every gradient except the Linear
// weights' and biases', and WeightGradRecords::backward() later turns the
// records into those without traversing the graph again.
struct LinearRecord : torch::CustomClassHolder {
  torch::Tensor input;        // what forward multiplied (its version is checked before use)
  torch::Tensor weight;       // the tensor forward computed with: param(weight), maybe a transform's view
  torch::Tensor bias;         // undefined without a bias in forward (none, or bias_after)
  torch::Tensor grad_output;  // set by backward; undefined until then (or if the output got no gradient)
  int64_t input_version = 0;
};

// The records of one (stage, microbatch) forward, in forward order.
class WeightGradRecords {
 public:
  void add(c10::intrusive_ptr<LinearRecord> r) { records_.push_back(std::move(r)); }
  size_t size() const { return records_.size(); }
  bool empty() const { return records_.empty(); }
  // For every record whose backward ran: dW = grad_output^T x and db = grad_output summed to the bias (the
  // matmuls and sums autograd's mm/addmm backward does), then one torch::autograd::backward from the
  // recorded weights and biases, so the gradients reach the parameters through whatever graph links a
  // weight view to its parameter (fully_shard's all-gather, a leaf directly) and through their hooks.
  // Clears the records. Must run after the backward that set the output gradients.
  void backward();
  void clear() { records_.clear(); }

 private:
  std::vector<c10::intrusive_ptr<LinearRecord>> records_;
};

// Opens a deferred-weight-gradient scope on this thread for its lifetime
// (nullptr: a scope that defers nothing, for code that defers conditionally).
class DeferWeightGrads {
 public:
  explicit DeferWeightGrads(WeightGradRecords* into);
  ~DeferWeightGrads();
  DeferWeightGrads(const DeferWeightGrads&) = delete;
  DeferWeightGrads& operator=(const DeferWeightGrads&) = delete;
  // The records of the innermost open scope on this thread, or nullptr.
  static WeightGradRecords* active();

 private:
  WeightGradRecords* previous_;
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

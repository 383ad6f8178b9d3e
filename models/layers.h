// The building blocks of the seed models, with PyTorch's parameter names,
// default initialisation and math: Linear, Embedding, LayerNorm, RMSNorm and
// the parameter-free activations that PyTorch registers as modules.
#pragma once
#include "models/float8.h"
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
  // A transform's computation in place of torch::linear(x, w, b) (tensor
  // parallelism's collective fused with the matmul), run while no
  // DeferWeightGrads scope is open; an undefined result falls back to it.
  std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b)> fused;
  // train.fp8: the matmuls in float8 (models/float8.h), in place of `fused`, while no
  // DeferWeightGrads scope is open; fp8_amax makes a sharded operand's scale the whole tensor's.
  bool fp8 = false;
  Fp8AmaxReduce fp8_amax;
  // train.lora (PEFT's LoRA): forward adds lora_scaling * lora_B(lora_A(dropout(x))) to the
  // layer's output, computed where the layer computes (a tensor-parallel rank's piece, before the
  // reduction of a rowwise layer). Undefined without an adapter.
  torch::Tensor lora_A;  // [rank, in_features], kaiming-uniform as PEFT draws it
  torch::Tensor lora_B;  // [out_features, rank], zeros
  double lora_scaling = 0;
  double lora_dropout = 0;
  // Registers lora_A and lora_B (scaling alpha / rank).
  void add_lora(int64_t rank, double alpha, double dropout);

 private:
  torch::Tensor base_forward(const torch::Tensor& x);
};

// The weight gradient of y = linear(x, w) from the flattened input x2 and
// output gradient g2, as autograd's mm backward computes it (mm_mat2_backward
// for mat2 = w^T, transposed back to w's layout).
torch::Tensor linear_weight_grad(const torch::Tensor& w, const torch::Tensor& x2, const torch::Tensor& g2);

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
  torch::Tensor kept_output;  // the output kept by op-mode activation checkpointing: forward returns it (once)
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

// x * rsqrt(mean(x^2) + eps) * weight, normalised in float32 (torchtitan's RMSNorm); on a GPU
// through PyTorch's fused kernel (F.rms_norm's).
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
// softmax(q k^T / sqrt(head_dim) [+ causal mask]) v on (batch, heads, seq, head_dim), through
// LibTorch's scaled_dot_product_attention, as the PyTorch reference computes it for the goldens
// (F.scaled_dot_product_attention). Its fused kernels never materialise the seq x seq scores: flash
// attention on the CPU when no dropout is active, flash or memory-efficient attention on a GPU. On the
// meta device of the estimate's dry run, a fused kernel is stood for by its allocations.
// With `mask` ((batch, 1, q_len, k_len) booleans, true: attend; packed documents) it replaces the causal
// flag, as F.scaled_dot_product_attention(attn_mask=mask) takes it: the CPU's flash kernel still serves.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        bool causal, double dropout_p, bool training, const torch::Tensor& mask = {});

// While one lives on this thread, meta tensors (the estimate's dry run) stand for a GPU's kernels:
// attention() fused also under dropout, with a float32 query-gradient accumulator in backward, and
// RMSNorm fused (the input and a float32 inverse RMS per row saved). Without it, for the CPU's:
// attention fused (the output and a float32 log-sum-exp per query row saved, never the scores) only
// when no dropout is active, RMSNorm in its float32 form. The dry run of a cuda plan holds one.
class GpuKernelShapes {
 public:
  explicit GpuKernelShapes(bool on);
  ~GpuKernelShapes();
  GpuKernelShapes(const GpuKernelShapes&) = delete;
  GpuKernelShapes& operator=(const GpuKernelShapes&) = delete;

 private:
  bool previous_;
};
}  // namespace composer::nn

namespace composer::nn {

// BatchNorm1d(num_features) with PyTorch's names: parameters weight (ones)
// and bias (zeros); buffers running_mean (zeros), running_var (ones) and
// num_batches_tracked (int64). In training mode it normalises with the batch
// statistics of each feature (dim 1, over every other dim) and moves the
// running statistics by `momentum`; in eval mode it uses the running ones.
// The buffers are this module's own: no transform shards, reduces or
// optimises them (under data parallelism each rank keeps its own, as DDP
// without SyncBatchNorm does).
class BatchNorm1d : public Module {
 public:
  explicit BatchNorm1d(int64_t num_features, double eps = 1e-5, double momentum = 0.1);
  torch::Tensor forward(torch::Tensor x) override;
  // Module::to(dtype) would turn every buffer into `dtype`; num_batches_tracked stays int64.
  using Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  int64_t num_features;
  double eps, momentum;
};

// nn.MultiheadAttention(embed_dim, num_heads, dropout) on seq-first inputs
// (seq, batch, embed_dim), with PyTorch's names (in_proj_weight, in_proj_bias,
// out_proj) and initialisation (xavier_uniform_ in_proj_weight, zero biases)
// and its need_weights=False math: q, k, v from the packed projection, softmax
// attention per head, out_proj. forward(x) is self-attention on x. With
// key_value_len k > 0 it is attention from a query onto another sequence,
// both travelling in the one input: x is the query rows followed by the k
// key/value rows (cat on dim 0); the output has the query's rows.
class MultiheadAttention : public Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout, int64_t key_value_len = 0);
  torch::Tensor forward(torch::Tensor x) override;
  torch::Tensor in_proj_weight, in_proj_bias;
  std::shared_ptr<Linear> out_proj;
  int64_t embed_dim, num_heads, key_value_len;
  double dropout;
};

}  // namespace composer::nn

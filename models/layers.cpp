#include "models/layers.h"

#include <cmath>

namespace composer::nn {

Linear::Linear(int64_t in, int64_t out, bool with_bias, torch::Tensor tied_weight)
    : Module("Linear"), in_features(in), out_features(out) {
  if (tied_weight.defined()) {
    TORCH_INTERNAL_ASSERT(tied_weight.size(0) == out && tied_weight.size(1) == in);
    weight = register_parameter("weight", tied_weight);
  } else {
    weight = register_parameter("weight", torch::empty({out, in}));
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  }
  if (with_bias) {
    bias = register_parameter("bias", torch::empty({out}));
    double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

torch::Tensor Linear::forward(torch::Tensor x) {
  return torch::linear(x, param(weight), bias.defined() && !bias_after ? param(bias) : torch::Tensor());
}

Embedding::Embedding(int64_t n, int64_t d) : Module("Embedding"), num_embeddings(n), embedding_dim(d) {
  weight = register_parameter("weight", torch::empty({n, d}));
  torch::nn::init::normal_(weight);
}

torch::Tensor Embedding::forward(torch::Tensor ids) { return torch::embedding(param(weight), ids); }

LayerNorm::LayerNorm(int64_t d, double e, bool with_bias) : Module("LayerNorm"), dim(d), eps(e) {
  weight = register_parameter("weight", torch::ones({d}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({d}));
}

torch::Tensor LayerNorm::forward(torch::Tensor x) {
  return torch::layer_norm(x, {dim}, param(weight), bias.defined() ? param(bias) : torch::Tensor(),
                           eps);
}

RMSNorm::RMSNorm(int64_t d, double e) : Module("RMSNorm"), dim(d), eps(e) {
  weight = register_parameter("weight", torch::ones({d}));
}

torch::Tensor RMSNorm::forward(torch::Tensor x) {
  auto xf = x.to(torch::kFloat);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * param(weight);
}

void trunc_normal_(torch::Tensor t, double mean, double std, double a, double b) {
  torch::NoGradGuard no_grad;
  auto norm_cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  double l = norm_cdf((a - mean) / std), u = norm_cdf((b - mean) / std);
  t.uniform_(2 * l - 1, 2 * u - 1);
  t.erfinv_();
  t.mul_(std * std::sqrt(2.0));
  t.add_(mean);
  t.clamp_(a, b);
}

}  // namespace composer::nn

namespace composer::nn {
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        bool causal, double dropout_p, bool training) {
  const int64_t seq = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (causal) {
    auto mask = torch::ones({seq, k.size(-2)}, torch::dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
  }
  auto probs = torch::softmax(scores, -1);
  if (dropout_p > 0 && training) probs = torch::dropout(probs, dropout_p, true);
  return torch::matmul(probs, v);
}
}  // namespace composer::nn

// TransformerWithSharedParams of PyTorch's FSDP core tests (docs/scenarios.md
// M9): Embedding(vocab, d_model) tied to the output projection, nn.Transformer
// (post-norm encoder and decoder layers on seq-first activations, each stack
// with its final LayerNorm), buffers vocab_bias (float ones) and long_buffer
// (int64 zeros) added to the embedded source, and BatchNorm1d(bs) on the
// embedded target.
//
// One sample is one whole (src, tgt) input of the seed's forward: src is
// (src_len, bs) and tgt (tgt_len, bs) token ids, seq-first; a sample travels
// as the src_len*bs + tgt_len*bs token ids src.view(-1) ++ tgt.view(-1), and
// its output is (tgt_len, bs, vocab_size), the seed's output. A batch of n
// samples runs through the transformer as n*bs columns at once (attention
// and the norms act per column, so this is the per-sample forward), while
// BatchNorm1d runs on each sample's (tgt_len, bs, d_model) slice on its own:
// its batch statistics, per column over (tgt_len, d_model), never mix
// samples, so any split of the batch over ranks or microbatches computes what
// one device computes. The running statistics it keeps are each rank's own.
//
// Inside the module tree the two sequences travel in one tensor too: the
// decoder layers and the cross-attention take cat([query rows, memory rows])
// with the memory's length (src_len) fixed at construction.
#include "models/layers.h"
#include "models/model_decl.h"

namespace composer::models {
namespace {

using nn::LayerNorm;
using nn::Linear;
using nn::MultiheadAttention;

struct SharedArgs {
  int64_t vocab_size, d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, src_len, tgt_len, bs;
  double dropout_p;
  bool train_mode;  // else the seed's eval(): dropout off, BatchNorm on running statistics
};

// Post-norm: x = norm1(x + dropout1(self_attn(x))); x = norm2(x + dropout2(linear2(dropout(relu(linear1(x)))))).
class TransformerEncoderLayer : public nn::Module {
 public:
  explicit TransformerEncoderLayer(const SharedArgs& a) : Module("TransformerEncoderLayer"), p_(a.dropout_p) {
    self_attn = add("self_attn", std::make_shared<MultiheadAttention>(a.d_model, a.nhead, a.dropout_p));
    linear1 = add("linear1", std::make_shared<Linear>(a.d_model, a.dim_feedforward));
    linear2 = add("linear2", std::make_shared<Linear>(a.dim_feedforward, a.d_model));
    norm1 = add("norm1", std::make_shared<LayerNorm>(a.d_model));
    norm2 = add("norm2", std::make_shared<LayerNorm>(a.d_model));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = (*norm1)(x + drop((*self_attn)(x)));
    return (*norm2)(x + drop((*linear2)(drop(torch::relu((*linear1)(x))))));
  }
  torch::Tensor drop(const torch::Tensor& x) { return torch::dropout(x, p_, is_training()); }
  std::shared_ptr<MultiheadAttention> self_attn;
  std::shared_ptr<Linear> linear1, linear2;
  std::shared_ptr<LayerNorm> norm1, norm2;

 private:
  double p_;
};

// Post-norm with cross-attention onto the memory. Input: cat([x, memory]) on
// dim 0 (the memory is the last src_len rows); output: x's rows.
class TransformerDecoderLayer : public nn::Module {
 public:
  explicit TransformerDecoderLayer(const SharedArgs& a)
      : Module("TransformerDecoderLayer"), p_(a.dropout_p), memory_len_(a.src_len) {
    self_attn = add("self_attn", std::make_shared<MultiheadAttention>(a.d_model, a.nhead, a.dropout_p));
    multihead_attn =
        add("multihead_attn", std::make_shared<MultiheadAttention>(a.d_model, a.nhead, a.dropout_p, a.src_len));
    linear1 = add("linear1", std::make_shared<Linear>(a.d_model, a.dim_feedforward));
    linear2 = add("linear2", std::make_shared<Linear>(a.dim_feedforward, a.d_model));
    norm1 = add("norm1", std::make_shared<LayerNorm>(a.d_model));
    norm2 = add("norm2", std::make_shared<LayerNorm>(a.d_model));
    norm3 = add("norm3", std::make_shared<LayerNorm>(a.d_model));
  }
  torch::Tensor forward(torch::Tensor packed) override {
    auto x = packed.narrow(0, 0, packed.size(0) - memory_len_);
    auto memory = packed.narrow(0, x.size(0), memory_len_);
    x = (*norm1)(x + drop((*self_attn)(x)));
    x = (*norm2)(x + drop((*multihead_attn)(torch::cat({x, memory}, 0))));
    return (*norm3)(x + drop((*linear2)(drop(torch::relu((*linear1)(x))))));
  }
  torch::Tensor drop(const torch::Tensor& x) { return torch::dropout(x, p_, is_training()); }
  std::shared_ptr<MultiheadAttention> self_attn, multihead_attn;
  std::shared_ptr<Linear> linear1, linear2;
  std::shared_ptr<LayerNorm> norm1, norm2, norm3;

 private:
  double p_;
  int64_t memory_len_;
};

// nn.TransformerEncoder / nn.TransformerDecoder: layers, then the final norm.
// The decoder's input is cat([tgt, memory]) like its layers'.
class Stack : public nn::Module {
 public:
  Stack(const SharedArgs& a, bool decoder)
      : Module(decoder ? "TransformerDecoder" : "TransformerEncoder"), memory_len_(decoder ? a.src_len : 0) {
    layers = add("layers", std::make_shared<nn::ModuleList>());
    const int64_t n = decoder ? a.num_decoder_layers : a.num_encoder_layers;
    for (int64_t i = 0; i < n; ++i) {
      layers->push_back(decoder ? nn::ModulePtr(std::make_shared<TransformerDecoderLayer>(a))
                                : nn::ModulePtr(std::make_shared<TransformerEncoderLayer>(a)));
    }
    norm = add("norm", std::make_shared<LayerNorm>(a.d_model));
  }
  torch::Tensor forward(torch::Tensor x) override {
    torch::Tensor memory;
    if (memory_len_) {
      memory = x.narrow(0, x.size(0) - memory_len_, memory_len_);
      x = x.narrow(0, 0, x.size(0) - memory_len_);
    }
    for (size_t i = 0; i < layers->size(); ++i) x = (*layers->at(i))(memory_len_ ? torch::cat({x, memory}, 0) : x);
    return (*norm)(x);
  }
  std::shared_ptr<nn::ModuleList> layers;
  std::shared_ptr<LayerNorm> norm;

 private:
  int64_t memory_len_;
};

// nn.Transformer: input cat([src, tgt]) (src is the first src_len rows),
// output decoder(tgt, encoder(src)).
class Seq2Seq : public nn::Module {
 public:
  explicit Seq2Seq(const SharedArgs& a) : Module("Transformer"), src_len_(a.src_len) {
    encoder = add("encoder", std::make_shared<Stack>(a, false));
    decoder = add("decoder", std::make_shared<Stack>(a, true));
    // nn.Transformer builds one encoder (decoder) layer and deep-copies it, then
    // xavier_uniform_s every parameter of two or more dims: the copies keep the
    // first layer's linear1/linear2 biases.
    torch::NoGradGuard no_grad;
    for (auto* stack : {encoder.get(), decoder.get()}) {
      auto& first = *stack->layers->at(0);
      for (size_t i = 1; i < stack->layers->size(); ++i) {
        for (auto name : {"linear1.bias", "linear2.bias"}) {
          stack->layers->at(i)->named_parameters()[name].copy_(first.named_parameters()[name]);
        }
      }
    }
    for (auto& p : parameters()) {
      if (p.dim() > 1) torch::nn::init::xavier_uniform_(p);
    }
  }
  torch::Tensor forward(torch::Tensor x) override {
    auto src = x.narrow(0, 0, src_len_), tgt = x.narrow(0, src_len_, x.size(0) - src_len_);
    return (*decoder)(torch::cat({tgt, (*encoder)(src)}, 0));
  }
  std::shared_ptr<Stack> encoder, decoder;

 private:
  int64_t src_len_;
};

class TransformerWithSharedParams : public Model {
 public:
  explicit TransformerWithSharedParams(const SharedArgs& a) : Model("TransformerWithSharedParams"), a_(a) {
    embed_tokens = add("embed_tokens", std::make_shared<nn::Embedding>(a.vocab_size, a.d_model));
    transformer = add("transformer", std::make_shared<Seq2Seq>(a));
    output_proj = add("output_proj", std::make_shared<Linear>(a.d_model, a.vocab_size, true, embed_tokens->weight));
    vocab_bias = register_buffer("vocab_bias", torch::ones({a.d_model}, nn::param_options()));
    long_buffer = register_buffer("long_buffer", torch::zeros({a.d_model}, nn::param_options().dtype(torch::kLong)));
    bn = add("bn", std::make_shared<nn::BatchNorm1d>(a.bs));
    train(true);  // applies the mode
  }

  // ids: (n, src_len*bs + tgt_len*bs) -> (n, tgt_len, bs, vocab_size).
  torch::Tensor forward(torch::Tensor ids) override {
    const int64_t n = ids.size(0), bs = a_.bs, width = (a_.src_len + a_.tgt_len) * bs;
    TORCH_CHECK(ids.dim() == 2 && ids.size(1) == width, "transformer_with_shared_params takes ", width,
                " token ids per sample (src_len x bs, then tgt_len x bs), got shape ", ids.sizes(),
                "; leave data.seq_len unset");
    auto columns = [&](int64_t begin, int64_t len) {  // (n, len*bs) -> (len, n*bs), sample i in columns i*bs..
      return ids.narrow(1, begin, len * bs).reshape({n, len, bs}).permute({1, 0, 2}).reshape({len, n * bs});
    };
    auto src = (*embed_tokens)(columns(0, a_.src_len));
    // The buffers compute in the embedding's dtype (FSDP1 MixedPrecision's buffer_dtype follows param_dtype).
    src = src + vocab_bias.to(src.scalar_type()) + long_buffer.to(src.scalar_type());
    auto tgt = (*embed_tokens)(columns(a_.src_len * bs, a_.tgt_len));
    std::vector<torch::Tensor> normed;
    for (int64_t i = 0; i < n; ++i) normed.push_back((*bn)(tgt.narrow(1, i * bs, bs)));
    auto out = (*output_proj)((*transformer)(torch::cat({src, torch::cat(normed, 1)}, 0)));
    return out.view({a_.tgt_len, n, bs, a_.vocab_size}).permute({1, 0, 2, 3});
  }

  // mode eval keeps the seed's model.eval() through training: train() leaves it in eval.
  void train(bool on) override { Model::train(on && a_.train_mode); }
  // Module::to(dtype) would turn every buffer into `dtype`; long_buffer stays int64.
  using Model::to;
  void to(torch::Dtype dtype, bool non_blocking) override {
    Model::to(dtype, non_blocking);
    long_buffer.set_data(long_buffer.to(torch::kLong));
  }

  InputSpec input_spec() const override { return {true, 0, a_.vocab_size, (a_.src_len + a_.tgt_len) * a_.bs}; }

  std::shared_ptr<nn::Embedding> embed_tokens;
  std::shared_ptr<Seq2Seq> transformer;
  std::shared_ptr<Linear> output_proj;
  std::shared_ptr<nn::BatchNorm1d> bn;
  torch::Tensor vocab_bias, long_buffer;

 private:
  SharedArgs a_;
};

void check_shared_args(const ModelArgs& a) {
  for (auto n : {"vocab_size", "d_model", "nhead", "num_encoder_layers", "num_decoder_layers", "dim_feedforward",
                 "src_len", "tgt_len", "bs"}) {
    require_arg_positive(a, n);
  }
  require_arg_divides(a, "nhead", "d_model");
  if (a.f("dropout_p") < 0 || a.f("dropout_p") >= 1) {
    throw ArgError("dropout_p", "dropout_p must be in [0, 1), got " + std::to_string(a.f("dropout_p")));
  }
  if (a.s("mode") != "eval" && a.s("mode") != "train") {
    throw ArgError("mode", "mode must be eval or train, got '" + a.s("mode") + "'");
  }
}

std::shared_ptr<TransformerWithSharedParams> build_shared(const ModelArgs& a) {
  SharedArgs t{a.i("vocab_size"),
               a.i("d_model"),
               a.i("nhead"),
               a.i("num_encoder_layers"),
               a.i("num_decoder_layers"),
               a.i("dim_feedforward"),
               a.i("src_len"),
               a.i("tgt_len"),
               a.i("bs"),
               a.f("dropout_p"),
               a.s("mode") == "train"};
  return std::make_shared<TransformerWithSharedParams>(t);
}

}  // namespace

std::vector<ModelSpec> transformer_shared_specs() {
  return {
      ModelDecl<TransformerWithSharedParams>(
          "transformer_with_shared_params",
          "TransformerWithSharedParams of the FSDP core tests: tied embedding, nn.Transformer, buffers, BatchNorm1d")
          .args({int_arg("vocab_size", 23, "vocabulary of embed_tokens and output_proj (tied)"),
                 int_arg("d_model", 16, "model width"), int_arg("nhead", 8, "attention heads; must divide d_model"),
                 int_arg("num_encoder_layers", 2, "encoder layers"), int_arg("num_decoder_layers", 2, "decoder layers"),
                 int_arg("dim_feedforward", 8, "feed-forward width of every layer"),
                 float_arg("dropout_p", 0.1, "dropout of every layer (train mode only)"),
                 int_arg("src_len", 6, "source positions per sample"),
                 int_arg("tgt_len", 4, "target positions per sample"),
                 int_arg("bs", 2, "columns per sample: the seed's batch, BatchNorm1d's features"),
                 string_arg("mode", "eval",
                            "eval (the seed's: dropout off and BatchNorm on its running statistics while "
                            "training) or train")})
          .check(check_shared_args)
          .build(build_shared)};
}

}  // namespace composer::models

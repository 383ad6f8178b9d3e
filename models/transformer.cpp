// The Transformer of PyTorch's DTensor tests (docs/scenarios.md M4): token and
// position embeddings, causal multi-head attention, LayerNorm, GELU
// feed-forward, optional weight tying between output and tok_embeddings.
#include "models/layers.h"
#include "models/model_decl.h"

namespace composer::models {
namespace {

using nn::Linear;

struct TransformerArgs {
  int64_t n_layers, vocab_size, max_seq_len, dim, n_heads;
  double dropout_p;
  bool use_attn_mask, weight_tying;
};

class Attention : public nn::Module {
 public:
  Attention(const TransformerArgs& a, std::shared_ptr<nn::SequenceSlot> slot)
      : Module("Attention"), args_(a), slot_(std::move(slot)) {
    wq = add("wq", std::make_shared<Linear>(a.dim, a.dim, false));
    wk = add("wk", std::make_shared<Linear>(a.dim, a.dim, false));
    wv = add("wv", std::make_shared<Linear>(a.dim, a.dim, false));
    wo = add("wo", std::make_shared<Linear>(a.dim, a.dim, false));
  }
  torch::Tensor forward(torch::Tensor x) override {
    const int64_t b = x.size(0), s = x.size(1), hd = args_.dim / args_.n_heads;
    // Under tensor parallelism wq/wk/wv produce a slice of the heads: infer the local count.
    auto split = [&](const torch::Tensor& t) { return t.view({b, s, -1, hd}).transpose(1, 2); };
    auto q = split((*wq)(x)), k = split((*wk)(x)), v = split((*wv)(x));
    const torch::Tensor& docs = slot_->doc_start();
    auto out = slot_->split ? slot_->split->attention(q, k, v, args_.use_attn_mask, docs)
                            : nn::attention(q, k, v, args_.use_attn_mask, args_.dropout_p, is_training(),
                                            docs.defined() ? slot_->document_mask(args_.use_attn_mask) : torch::Tensor());
    out = out.transpose(1, 2).contiguous().view({b, s, -1});
    return torch::dropout((*wo)(out), args_.dropout_p, is_training());
  }
  std::shared_ptr<Linear> wq, wk, wv, wo;

 private:
  TransformerArgs args_;
  std::shared_ptr<nn::SequenceSlot> slot_;
};

class FeedForward : public nn::Module {
 public:
  FeedForward(int64_t dim, int64_t hidden, double dropout_p) : Module("FeedForward"), p_(dropout_p) {
    w1 = add("w1", std::make_shared<Linear>(dim, hidden));
    w2 = add("w2", std::make_shared<Linear>(hidden, dim));
  }
  torch::Tensor forward(torch::Tensor x) override {
    return torch::dropout((*w2)(torch::gelu((*w1)(x))), p_, is_training());
  }
  std::shared_ptr<Linear> w1, w2;

 private:
  double p_;
};

class TransformerBlock : public nn::Module {
 public:
  TransformerBlock(const TransformerArgs& a, std::shared_ptr<nn::SequenceSlot> slot) : Module("TransformerBlock") {
    attention_norm = add("attention_norm", std::make_shared<nn::LayerNorm>(a.dim));
    attention = add("attention", std::make_shared<Attention>(a, std::move(slot)));
    ffn_norm = add("ffn_norm", std::make_shared<nn::LayerNorm>(a.dim));
    feed_forward = add("feed_forward", std::make_shared<FeedForward>(a.dim, 4 * a.dim, a.dropout_p));
  }
  torch::Tensor forward(torch::Tensor x) override {
    auto h = x + (*attention)((*attention_norm)(x));
    return h + (*feed_forward)((*ffn_norm)(h));
  }
  std::shared_ptr<nn::LayerNorm> attention_norm, ffn_norm;
  std::shared_ptr<Attention> attention;
  std::shared_ptr<FeedForward> feed_forward;
};

class Transformer : public Model {
 public:
  explicit Transformer(const TransformerArgs& a) : Model("Transformer"), args_(a) {
    tok_embeddings = add("tok_embeddings", std::make_shared<nn::Embedding>(a.vocab_size, a.dim));
    pos_embeddings = add("pos_embeddings", std::make_shared<nn::Embedding>(a.max_seq_len, a.dim));
    layers = add("layers", std::make_shared<nn::ModuleList>());
    for (int64_t i = 0; i < a.n_layers; ++i) layers->push_back(std::make_shared<TransformerBlock>(a, slot_));
    norm = add("norm", std::make_shared<nn::LayerNorm>(a.dim));
    output = add("output", std::make_shared<Linear>(a.dim, a.vocab_size, false,
                                                    a.weight_tying ? tok_embeddings->weight : torch::Tensor()));
  }
  torch::Tensor forward(torch::Tensor tokens) override {
    auto h = embed(tokens);
    for (size_t i = 0; i < layers->size(); ++i) h = (*layers->at(i))(h);
    return (*output)((*norm)(h)).to(torch::kFloat);
  }
  // Token plus position embeddings (the positions of this rank's tokens under a sequence split).
  torch::Tensor embed(const torch::Tensor& tokens) {
    auto pos = nn::positions(slot_.get(), tokens.size(1), tokens.device());
    // Packed documents' positions are per sample, (b, s): looked up sequence-first, so that a
    // sequence-parallel plan's split of the lookup's dim 0 is the sequence's, as for (s) positions.
    auto h = (*tok_embeddings)(tokens) +
             (pos.dim() == 2 ? (*pos_embeddings)(pos.t()).transpose(0, 1) : (*pos_embeddings)(pos));
    return torch::dropout(h, args_.dropout_p, is_training());
  }
  // Every attention's slot, and the positions of the embeddings.
  nn::SequenceSlot* slot() { return slot_.get(); }
  InputSpec input_spec() const override { return {true, 0, args_.vocab_size, args_.max_seq_len}; }
  // tok_embeddings with pos_embeddings, one piece per layer, then norm with output.
  std::vector<PipelinePiece> pieces() {
    std::vector<PipelinePiece> out;
    out.push_back({"tok_embeddings", {"tok_embeddings", "pos_embeddings"}, false,
                   [this](torch::Tensor tokens) { return embed(tokens); }});
    for (auto& piece : layer_pieces("layers", *layers)) out.push_back(std::move(piece));
    out.push_back({"norm", {"norm", "output"}, false,
                   [this](torch::Tensor h) { return (*output)((*norm)(h)).to(torch::kFloat); }});
    return out;
  }

  std::shared_ptr<nn::Embedding> tok_embeddings, pos_embeddings;
  std::shared_ptr<nn::ModuleList> layers;
  std::shared_ptr<nn::LayerNorm> norm;
  std::shared_ptr<Linear> output;

 private:
  TransformerArgs args_;
  std::shared_ptr<nn::SequenceSlot> slot_ = std::make_shared<nn::SequenceSlot>();
};

void check_transformer_args(const ModelArgs& a) {
  for (auto n : {"n_layers", "vocab_size", "max_seq_len", "dim", "n_heads"}) require_arg_positive(a, n);
  require_arg_divides(a, "n_heads", "dim");
  if (a.f("dropout_p") < 0 || a.f("dropout_p") >= 1) {
    throw ArgError("dropout_p", "dropout_p must be in [0, 1), got " + std::to_string(a.f("dropout_p")));
  }
}

std::shared_ptr<Transformer> build_transformer(const ModelArgs& a) {
  TransformerArgs t{a.i("n_layers"), a.i("vocab_size"), a.i("max_seq_len"),   a.i("dim"),
                    a.i("n_heads"),  a.f("dropout_p"),  a.b("use_attn_mask"), a.b("weight_tying")};
  return std::make_shared<Transformer>(t);
}

// The ring attention has no attention dropout (nor could ranks draw one device's masks).
void check_transformer_cp(const ModelArgs& a) {
  if (a.f("dropout_p") > 0) {
    throw ArgError("dropout_p",
                   "context_parallel's attention applies no dropout and its ranks cannot draw one "
                   "device's dropout masks; set model.args.dropout_p: 0");
  }
}

// docs/scenarios.md M4's Transformer.parallelize: embeddings vocab/position
// parallel, head-split attention, colwise/rowwise feed-forward, colwise
// output (tied to tok_embeddings, both sharded on the vocab dim); with
// sequence parallelism the norms and residual stream are sequence-sharded.
TpPlan transformer_tp_plan(const ModelArgs&, bool sp) {
  const Layout rep = Layout::replicate(), seq = Layout::shard(1);
  TpPlan p;
  if (sp) {
    p = {rowwise("tok_embeddings", rep, seq),
         rowwise("pos_embeddings", rep, Layout::shard(0)),
         sequence_parallel("norm"),
         prepare_input("layers.*.attention", seq, rep),
         sequence_parallel("layers.*.attention_norm"),
         sequence_parallel("layers.*.ffn_norm"),
         rowwise("layers.*.attention.wo", Layout::shard(-1), seq),
         colwise("layers.*.feed_forward.w1", seq),
         rowwise("layers.*.feed_forward.w2", Layout::shard(-1), seq),
         colwise("output", seq, rep)};
  } else {
    p = {rowwise("tok_embeddings", rep, rep), rowwise("pos_embeddings", rep, rep), rowwise("layers.*.attention.wo"),
         colwise("layers.*.feed_forward.w1"), rowwise("layers.*.feed_forward.w2"), colwise("output", rep, rep)};
  }
  for (auto w : {"wq", "wk", "wv"}) p.push_back(colwise(std::string("layers.*.attention.") + w));
  return p;
}

// tp divides the heads.
void check_transformer_tp(const ModelArgs& a, int64_t tp, bool) {
  if (a.i("n_heads") % tp != 0) {
    throw ArgError("n_heads", "tp degree " + std::to_string(tp) + " does not divide n_heads " +
                                  std::to_string(a.i("n_heads")) + " (model.args.n_heads); use a tp that divides it");
  }
}

}  // namespace

std::vector<ModelSpec> transformer_specs() {
  return {
      ModelDecl<Transformer>(
          "transformer", "Transformer(ModelArgs) of PyTorch's DTensor tests: embeddings, causal attention, GELU FFN")
          .args({int_arg("n_layers", 2, "number of TransformerBlocks"), int_arg("vocab_size", 8, "vocabulary size"),
                 int_arg("max_seq_len", 16, "positions in pos_embeddings"), int_arg("dim", 16, "model width"),
                 int_arg("n_heads", 4, "attention heads; must divide dim"),
                 float_arg("dropout_p", 0.1, "dropout probability (0 for parity runs)"),
                 bool_arg("use_attn_mask", true, "causal attention"),
                 bool_arg("weight_tying", true, "output.weight is tok_embeddings.weight")})
          .check(check_transformer_args)
          .build(build_transformer)
          .pipeline(&Transformer::pieces)
          .context_parallel(&Transformer::slot, check_transformer_cp)
          .tp_plan(transformer_tp_plan, check_transformer_tp)
          .logits("output")};
}

}  // namespace composer::models

// The Llama-style transformer of torchtitan (docs/scenarios.md M14): RMSNorm, rotary
// position embeddings, grouped-query attention (n_kv_heads), SwiGLU
// feed-forward, blocks named layers.0 .. layers.<n-1>, depth-scaled init.
#include <cmath>
#include <sstream>

#include "models/layers.h"
#include "models/model_decl.h"
#include "models/moe.h"
#include "models/rope.h"

namespace composer::models {

// Whether layer `layer` of a llama (or qwen3) with `a` has a routed
// feed-forward: n_experts, past the first n_dense_layers, every
// moe_layer_step-th layer.
bool llama_routed_layer(const ModelArgs& a, int64_t layer);

namespace {

using nn::Linear;

struct LlamaArgs {
  int64_t dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of, max_seq_len, hidden_dim;
  double ffn_dim_multiplier, norm_eps;
  bool depth_init, weight_tying;
  MoeArgs moe;  // moe.experts 0: every block's feed-forward is dense
  ModelArgs args;  // every argument: the rotary scaling (models/rope.h), which layers route (llama_routed_layer)
  int64_t head_dim_given = 0;  // 0: dim / n_heads
  bool qk_norm = false;        // Qwen3's per-head RMSNorm of q and k before the rotary
  int64_t head_dim() const { return head_dim_given > 0 ? head_dim_given : dim / n_heads; }
  int64_t ffn_hidden() const {
    if (hidden_dim > 0) return hidden_dim;  // given (a Hugging Face intermediate_size)
    int64_t hidden = 2 * (4 * dim) / 3;
    if (ffn_dim_multiplier > 0) hidden = static_cast<int64_t>(ffn_dim_multiplier * hidden);
    return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
  }
};

// Rotates (x0, x1) pairs of the last dim by position-dependent angles: the real
// form of torchtitan's complex multiply by freqs_cis.
// On a GPU as torchtitan computes it (a complex multiply: fewer kernels, no
// select or stack); on the CPU in the real form, op for op the goldens'.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  if (x.is_cuda()) {
    auto xc = torch::view_as_complex(x.to(torch::kFloat).reshape({x.size(0), x.size(1), x.size(2), -1, 2}));
    auto freqs = torch::complex(cos, sin).view({cos.dim() == 3 ? x.size(0) : 1, x.size(1), 1, -1});
    return torch::view_as_real(xc * freqs).flatten(3).to(x.scalar_type());
  }
  auto xf = x.to(torch::kFloat);
  auto pairs = xf.reshape({x.size(0), x.size(1), x.size(2), -1, 2});
  auto x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
  const int64_t rows = cos.dim() == 3 ? x.size(0) : 1;  // per sample: packed documents' positions
  auto c = cos.view({rows, x.size(1), 1, -1}), s = sin.view({rows, x.size(1), 1, -1});
  auto out = torch::stack({x0 * c - x1 * s, x0 * s + x1 * c}, -1).flatten(3);
  return out.to(x.scalar_type());
}

class Attention : public nn::Module {
 public:
  Attention(const LlamaArgs& a, std::shared_ptr<nn::SequenceSlot> slot)
      : Module("Attention"), hd_(a.head_dim()), slot_(std::move(slot)) {
    wq = add("wq", std::make_shared<Linear>(a.dim, a.n_heads * hd_, false));
    wk = add("wk", std::make_shared<Linear>(a.dim, a.n_kv_heads * hd_, false));
    wv = add("wv", std::make_shared<Linear>(a.dim, a.n_kv_heads * hd_, false));
    wo = add("wo", std::make_shared<Linear>(a.n_heads * hd_, a.dim, false));
    if (a.qk_norm) {  // one weight over head_dim, shared by every head
      q_norm = add("q_norm", std::make_shared<nn::RMSNorm>(hd_, a.norm_eps));
      k_norm = add("k_norm", std::make_shared<nn::RMSNorm>(hd_, a.norm_eps));
    }
  }
  void set_rope(torch::Tensor cos, torch::Tensor sin) {
    cos_ = std::move(cos);
    sin_ = std::move(sin);
  }
  torch::Tensor forward(torch::Tensor x) override {
    const int64_t b = x.size(0), s = x.size(1);
    auto q = (*wq)(x).view({b, s, -1, hd_}), k = (*wk)(x).view({b, s, -1, hd_});
    auto v = (*wv)(x).view({b, s, -1, hd_});
    if (q_norm) {
      q = (*q_norm)(q);
      k = (*k_norm)(k);
    }
    torch::Tensor cos, sin;
    const torch::Tensor& docs = slot_->doc_start();
    if (slot_->split || docs.defined()) {
      // The angles of this rank's positions in a longer sequence, or of each token's position in its
      // document ((b, s) positions: angles per sample).
      auto pos = nn::positions(slot_.get(), s, cos_.device());
      const std::vector<int64_t> shape = pos.dim() == 2 ? std::vector<int64_t>{b, s, -1} : std::vector<int64_t>{s, -1};
      cos = cos_.index_select(0, pos.flatten()).view(shape).to(x.device());
      sin = sin_.index_select(0, pos.flatten()).view(shape).to(x.device());
    } else {
      cos = cos_.slice(0, 0, s).to(x.device());
      sin = sin_.slice(0, 0, s).to(x.device());
    }
    q = apply_rope(q, cos, sin);
    k = apply_rope(k, cos, sin);
    if (slot_->split) {  // the split repeats the key/value heads itself, after moving them
      auto out = slot_->split->attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), true, docs);
      return (*wo)(out.transpose(1, 2).contiguous().view({b, s, -1}));
    }
    const int64_t n_rep = q.size(2) / k.size(2);  // grouped-query attention
    if (n_rep > 1) {
      k = k.repeat_interleave(n_rep, 2);
      v = v.repeat_interleave(n_rep, 2);
    }
    auto out = nn::attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), true, 0, false,
                             docs.defined() ? slot_->document_mask(true) : torch::Tensor());
    return (*wo)(out.transpose(1, 2).contiguous().view({b, s, -1}));
  }
  std::shared_ptr<Linear> wq, wk, wv, wo;
  std::shared_ptr<nn::RMSNorm> q_norm, k_norm;  // qk_norm only

 private:
  int64_t hd_;
  std::shared_ptr<nn::SequenceSlot> slot_;
  torch::Tensor cos_, sin_;
};

class TransformerBlock : public nn::Module {
 public:
  TransformerBlock(int64_t layer_id, const LlamaArgs& a, std::shared_ptr<nn::SequenceSlot> slot)
      : Module("TransformerBlock") {
    attention = add("attention", std::make_shared<Attention>(a, std::move(slot)));
    if (llama_routed_layer(a.args, layer_id)) {
      MoeArgs m = a.moe;
      if (m.hidden <= 0) m.hidden = a.ffn_hidden();
      moe = add("feed_forward", std::make_shared<MoE>(a.dim, m));
    } else {
      feed_forward = add("feed_forward", std::make_shared<FeedForward>(a.dim, a.ffn_hidden()));
    }
    attention_norm = add("attention_norm", std::make_shared<nn::RMSNorm>(a.dim, a.norm_eps));
    ffn_norm = add("ffn_norm", std::make_shared<nn::RMSNorm>(a.dim, a.norm_eps));
    double std = a.depth_init ? 0.02 / std::sqrt(2.0 * (layer_id + 1)) : 0.02 / std::sqrt(2.0 * a.n_layers);
    auto trunc_normal = [](double s) { return [s](torch::Tensor& w) { nn::trunc_normal_(w, 0, s, -2, 2); }; };
    for (auto* w : {&attention->wq->weight, &attention->wk->weight, &attention->wv->weight}) {
      nn::init_param(*w, trunc_normal(0.02));
    }
    nn::init_param(attention->wo->weight, trunc_normal(std));
    // torchtitan's: the first SwiGLU projection at 0.02, the other two and the
    // router depth-scaled.
    auto init_swiglu = [&](FeedForward& f) {
      for (auto* w : {&f.w2->weight, &f.w3->weight}) nn::init_param(*w, trunc_normal(std));
      nn::init_param(f.w1->weight, trunc_normal(0.02));
    };
    if (feed_forward) init_swiglu(*feed_forward);
    if (moe) {
      nn::init_param(moe->router->weight, trunc_normal(std));
      for (auto* w : {&moe->experts->w2, &moe->experts->w3}) nn::init_param(*w, trunc_normal(std));
      nn::init_param(moe->experts->w1, trunc_normal(0.02));
      if (moe->shared) init_swiglu(*moe->shared);
    }
  }
  torch::Tensor forward(torch::Tensor x) override {
    auto h = x + (*attention)((*attention_norm)(x));
    auto n = (*ffn_norm)(h);
    return h + (feed_forward ? (*feed_forward)(n) : (*moe)(n));
  }
  std::shared_ptr<Attention> attention;
  std::shared_ptr<FeedForward> feed_forward;  // dense
  std::shared_ptr<MoE> moe;                   // or routed (model.args.n_experts)
  std::shared_ptr<nn::RMSNorm> attention_norm, ffn_norm;
};

class Llama : public Model {
 public:
  explicit Llama(const LlamaArgs& a) : Model("Transformer"), args_(a) {
    tok_embeddings = add("tok_embeddings", std::make_shared<nn::Embedding>(a.vocab_size, a.dim));
    layers = add("layers", std::make_shared<nn::ModuleList>());
    // Rotary tables for 2 * max_seq_len positions, as torchtitan precomputes them.
    auto [cos, sin] = rope_tables(a.args, a.head_dim(), 2 * a.max_seq_len);
    cos = cos.to(nn::buffer_options().device());
    sin = sin.to(nn::buffer_options().device());
    for (int64_t i = 0; i < a.n_layers; ++i) {
      auto block = std::make_shared<TransformerBlock>(i, a, slot_);
      block->attention->set_rope(cos, sin);
      layers->push_back(block);
    }
    norm = add("norm", std::make_shared<nn::RMSNorm>(a.dim, a.norm_eps));
    output = add("output", std::make_shared<Linear>(a.dim, a.vocab_size, false,
                                                    a.weight_tying ? tok_embeddings->weight : torch::Tensor()));
    nn::init_param(tok_embeddings->weight, [](torch::Tensor& w) { w.normal_(); });
    if (a.weight_tying) return;  // the output projection is the embedding, drawn once
    const double cutoff = 3.0 / std::sqrt(static_cast<double>(a.dim)), scale = 1.0 / std::sqrt(static_cast<double>(a.dim));
    nn::init_param(output->weight, [scale, cutoff](torch::Tensor& w) { nn::trunc_normal_(w, 0, scale, -cutoff, cutoff); });
  }
  torch::Tensor forward(torch::Tensor tokens) override {
    auto h = (*tok_embeddings)(tokens);
    for (size_t i = 0; i < layers->size(); ++i) h = (*layers->at(i))(h);
    return (*output)((*norm)(h)).to(torch::kFloat);
  }
  InputSpec input_spec() const override { return {true, 0, args_.vocab_size, args_.max_seq_len}; }
  // tok_embeddings, one piece per layer, then norm with output.
  std::vector<PipelinePiece> pieces() {
    std::vector<PipelinePiece> out;
    out.push_back({"tok_embeddings", {"tok_embeddings"}, false,
                   [this](torch::Tensor tokens) { return (*tok_embeddings)(tokens); }});
    for (auto& piece : layer_pieces("layers", *layers)) out.push_back(std::move(piece));
    out.push_back({"norm", {"norm", "output"}, false,
                   [this](torch::Tensor h) { return (*output)((*norm)(h)).to(torch::kFloat); }});
    return out;
  }

  std::shared_ptr<nn::Embedding> tok_embeddings;
  std::shared_ptr<nn::ModuleList> layers;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<Linear> output;
  // Every attention's slot: rotary angles by global position, GQA heads repeated after the ring.
  nn::SequenceSlot* slot() { return slot_.get(); }

 private:
  LlamaArgs args_;
  std::shared_ptr<nn::SequenceSlot> slot_ = std::make_shared<nn::SequenceSlot>();
};

void check_llama_args(const ModelArgs& a) {
  for (auto n : {"dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"}) {
    require_arg_positive(a, n);
  }
  if (a.i("head_dim") < 0) throw ArgError("head_dim", "head_dim must be 0 (dim / n_heads) or positive");
  if (a.i("head_dim") == 0) require_arg_divides(a, "n_heads", "dim");
  check_rope_args(a);
  if (a.i("hidden_dim") < 0) throw ArgError("hidden_dim", "hidden_dim must be 0 (derived) or positive");
  if (a.i("head_dim") == 0 && (a.i("dim") / a.i("n_heads")) % 2 != 0) {
    throw ArgError("n_heads", "head_dim dim/n_heads must be even for rotary embeddings");
  }
  if (a.i("head_dim") % 2 != 0) throw ArgError("head_dim", "head_dim must be even for rotary embeddings");
  if (a.i("n_experts") < 0) throw ArgError("n_experts", "n_experts must be 0 (a dense feed-forward) or positive");
  if (a.i("n_experts") == 0) {
    for (auto [n, def] : {std::pair<const char*, int64_t>{"n_dense_layers", 0}, {"moe_layer_step", 1}}) {
      if (a.i(n) != def) {
        throw ArgError(n, std::string(n) + " chooses which layers route in a mixture of experts; this model has "
                                           "n_experts 0: remove it or set n_experts");
      }
    }
  }
  if (a.i("n_experts") > 0) {
    if (a.i("moe_layer_step") < 1) throw ArgError("moe_layer_step", "moe_layer_step must be 1 (every layer) or more");
    bool any = false;
    for (int64_t i = 0; i < a.i("n_layers"); ++i) any = any || llama_routed_layer(a, i);
    if (a.i("n_dense_layers") < 0 || !any) {
      throw ArgError("n_dense_layers", "n_dense_layers " + std::to_string(a.i("n_dense_layers")) + " and moe_layer_step " +
                                           std::to_string(a.i("moe_layer_step")) + " leave no layer of " +
                                           std::to_string(a.i("n_layers")) + " routed (or n_dense_layers is negative); "
                                           "route at least one, or set n_experts: 0");
    }
  }
  if (a.i("n_experts") > 0) {
    if (a.i("top_k") < 1 || a.i("top_k") > a.i("n_experts")) {
      throw ArgError("top_k", "top_k " + std::to_string(a.i("top_k")) + " must be between 1 and n_experts " +
                                  std::to_string(a.i("n_experts")) + "; route each token to at most every expert");
    }
    if (a.i("n_shared_experts") < 0) throw ArgError("n_shared_experts", "n_shared_experts must be 0 or positive");
    if (a.i("moe_hidden_dim") < 0) {
      throw ArgError("moe_hidden_dim", "moe_hidden_dim must be 0 (the dense feed-forward's width) or positive");
    }
    if (a.s("score_func") != "softmax" && a.s("score_func") != "sigmoid") {
      throw ArgError("score_func", "score_func '" + a.s("score_func") + "' is not one of softmax, sigmoid");
    }
    if (!(a.f("route_scale") > 0)) throw ArgError("route_scale", "route_scale must be positive");
    for (auto n : {"aux_loss_coeff", "bias_update_rate", "capacity_factor", "z_loss_coeff"}) {
      if (!(a.f(n) >= 0)) {
        std::ostringstream os;
        os << n << " must be 0 (off) or positive, got " << a.f(n);
        throw ArgError(n, os.str());
      }
    }
  }
  if (a.i("n_kv_heads") < 0 || (a.i("n_kv_heads") > 0 && a.i("n_heads") % a.i("n_kv_heads") != 0)) {
    throw ArgError("n_kv_heads", "n_kv_heads " + std::to_string(a.i("n_kv_heads")) + " does not divide n_heads " +
                                     std::to_string(a.i("n_heads")) + "; use 0 or a divisor of n_heads");
  }
}

std::shared_ptr<Llama> build_llama(const ModelArgs& a) {
  LlamaArgs l{a.i("dim"),
              a.i("n_layers"),
              a.i("n_heads"),
              a.i("n_kv_heads") ? a.i("n_kv_heads") : a.i("n_heads"),
              a.i("vocab_size"),
              a.i("multiple_of"),
              a.i("max_seq_len"),
              a.i("hidden_dim"),
              a.f("ffn_dim_multiplier"),
              a.f("norm_eps"),
              a.b("depth_init"),
              a.b("weight_tying"),
              MoeArgs{a.i("n_experts"), a.i("top_k"), a.i("n_shared_experts"), a.i("moe_hidden_dim"),
                      a.s("score_func") == "sigmoid", a.b("route_norm"), a.f("route_scale"), a.f("aux_loss_coeff"),
                      a.f("bias_update_rate"), a.f("capacity_factor"), a.f("z_loss_coeff")},
              a,
              a.i("head_dim"),
              a.b("qk_norm")};
  return std::make_shared<Llama>(l);
}

// torchtitan's Llama plan: vocab-parallel embedding, head-split attention
// (n_heads/tp query heads, n_kv_heads/tp key/value heads), colwise w1/w3 and
// rowwise w2; with sequence parallelism, sequence-sharded norms. In
// mixture-of-experts blocks the shared experts split as the dense
// feed-forward does; the router and the routed experts stay whole on every tp
// rank (expert_parallel spreads those), so each tp rank routes the same tokens
// and their gradients need no reduction over tp.
TpPlan llama_tp_plan(const ModelArgs& a, bool sp) {
  const Layout rep = Layout::replicate(), seq = Layout::shard(1);
  TpPlan p;
  if (sp) {  // dense blocks only (check_llama_tp)
    p = {rowwise("tok_embeddings", rep, seq),
         sequence_parallel("norm"),
         colwise("output", seq, rep),
         sequence_parallel("layers.*.attention_norm"),
         sequence_parallel("layers.*.ffn_norm"),
         prepare_input("layers.*.attention", seq, rep),
         prepare_input("layers.*.feed_forward", seq, rep),
         rowwise("layers.*.attention.wo", Layout::shard(-1), seq),
         rowwise("layers.*.feed_forward.w2", Layout::shard(-1), seq)};
  }
  // The dense blocks' feed-forward and the mixture-of-experts blocks' shared experts (none: nothing to split).
  std::vector<std::string> ffns;
  bool dense = false, routed = false;
  for (int64_t i = 0; i < a.i("n_layers"); ++i) (llama_routed_layer(a, i) ? routed : dense) = true;
  if (dense) ffns.push_back("layers.*.feed_forward.");
  if (routed && a.i("n_shared_experts") > 0) ffns.push_back("layers.*.feed_forward.shared.");
  if (!sp) {
    p = {rowwise("tok_embeddings", rep, rep), colwise("output", rep, rep), rowwise("layers.*.attention.wo")};
    for (const auto& ffn : ffns) p.push_back(rowwise(ffn + "w2"));
  }
  for (auto w : {"attention.wq", "attention.wk", "attention.wv"}) p.push_back(colwise(std::string("layers.*.") + w));
  // Qwen3's q and k norms act on each rank's own heads: their weights' gradients are partial sums over tp.
  if (a.b("qk_norm")) {
    for (auto n : {"attention.q_norm", "attention.k_norm"}) p.push_back(sequence_parallel(std::string("layers.*.") + n));
  }
  for (const auto& ffn : ffns) {
    p.push_back(colwise(ffn + "w1"));
    p.push_back(colwise(ffn + "w3"));
  }
  return p;
}

// The load-balancing loss and the capacity count per sequence, which
// context parallelism splits over ranks.
void check_llama_cp(const ModelArgs& a) {
  if (a.i("n_experts") == 0) return;
  for (auto n : {"aux_loss_coeff", "capacity_factor"}) {
    if (a.f(n) > 0) {
      throw ArgError(n, std::string(n) + " counts each sequence's routing, which context_parallel splits over ranks; "
                                         "not supported together yet: set " + n + ": 0 or remove context_parallel");
    }
  }
}

// tp divides the query and the key/value heads.
void check_llama_tp(const ModelArgs& a, int64_t tp, bool sp) {
  if (a.i("n_experts") > 0 && sp) {
    throw ArgError("n_experts", "tensor_parallel's sequence_parallel has no plan for mixture-of-experts blocks yet "
                                    "(model.args.n_experts " + std::to_string(a.i("n_experts")) + "): their routed "
                                    "output is whole on every tp rank, not a sequence slice; set sequence_parallel: "
                                    "false");
  }
  const int64_t kv = a.i("n_kv_heads") ? a.i("n_kv_heads") : a.i("n_heads");
  for (auto [name, n] : {std::pair<const char*, int64_t>{"n_heads", a.i("n_heads")}, {"n_kv_heads", kv}}) {
    if (n % tp != 0) {
      throw ArgError(name, "tp degree " + std::to_string(tp) + " does not divide " + name + " " + std::to_string(n) +
                               " (model.args." + name + "); use a tp that divides it");
    }
  }
}

// The arguments: the widths, the rotary embedding (rope_args) and the mixture of experts.
std::vector<ArgSpec> llama_args() {
  std::vector<ArgSpec> args = {int_arg("dim", 256, "model width"), int_arg("n_layers", 8, "number of TransformerBlocks"),
                 int_arg("n_heads", 16, "query heads; must divide dim"),
                 int_arg("n_kv_heads", 0, "key/value heads; 0 means n_heads"),
                 int_arg("vocab_size", 256, "vocabulary size"),
                 int_arg("multiple_of", 256, "SwiGLU hidden width rounds up to this"),
                 float_arg("ffn_dim_multiplier", 0.0, "hidden width multiplier; 0 means none"),
                 float_arg("norm_eps", 1e-5, "RMSNorm epsilon"),
                 int_arg("max_seq_len", 2048, "longest sequence"),
                 bool_arg("depth_init", true, "scale output-projection init by layer depth"),
                 int_arg("hidden_dim", 0,
                         "SwiGLU hidden width; 0 derives it from dim, ffn_dim_multiplier and multiple_of"),
                 bool_arg("weight_tying", false, "output.weight is tok_embeddings.weight"),
                 quiet(int_arg("head_dim", 0, "each head's width; 0 means dim / n_heads")),
                 quiet(bool_arg("qk_norm", false, "RMSNorm of each query and key head before the rotary (Qwen3)")),
                 quiet(int_arg("n_dense_layers", 0,
                               "mixture of experts: the first layers keep a dense feed-forward (DeepSeek-V3's "
                               "first_k_dense_replace)")),
                 quiet(int_arg("moe_layer_step", 1,
                               "mixture of experts: layer i (from 0) routes when i + 1 is a multiple of this "
                               "(Qwen3-MoE's decoder_sparse_step); the others are dense")),
                 int_arg("n_experts", 0, "routed experts in every block's feed-forward (mixture of experts); 0 is dense"),
                 int_arg("top_k", 1, "experts each token is routed to"),
                 int_arg("n_shared_experts", 0, "experts every token goes through besides its routed ones"),
                 int_arg("moe_hidden_dim", 0, "each expert's SwiGLU hidden width; 0 means the dense width"),
                 string_arg("score_func", "softmax", "router scores: softmax over the experts, or sigmoid"),
                 bool_arg("route_norm", false, "divide each token's top_k scores by their sum"),
                 float_arg("route_scale", 1.0, "multiplier of the routing weights"),
                 float_arg("aux_loss_coeff", 0.0, "load-balancing loss coefficient (per sequence); 0 is none"),
                 float_arg("bias_update_rate", 0.0,
                           "auxiliary-loss-free balancing: the expert bias's step per optimizer step; 0 is none"),
                 float_arg("capacity_factor", 0.0,
                           "rows each expert takes per sequence, x seq_len x top_k / n_experts; 0 is dropless"),
                 float_arg("z_loss_coeff", 0.0, "router z-loss coefficient (per sequence, ST-MoE); 0 is none")};
  const std::vector<ArgSpec> rope = rope_args();
  args.insert(args.begin() + 8, rope.begin(), rope.end());  // after norm_eps, where rope_theta stood
  return args;
}

}  // namespace

bool llama_routed_layer(const ModelArgs& a, int64_t layer) {
  return a.i("n_experts") > 0 && layer >= a.i("n_dense_layers") && (layer + 1) % a.i("moe_layer_step") == 0;
}

std::shared_ptr<const HfAdapter> llama_hf_adapter();  // llama_hf.cpp
std::shared_ptr<const HfAdapter> qwen3_hf_adapter();  // llama_hf.cpp

namespace {

// The decoder's declaration under `name`, with its arguments and Hugging Face adapter.
ModelDecl<Llama> decoder_decl(std::string name, std::string doc, std::vector<ArgSpec> args,
                              std::shared_ptr<const HfAdapter> hf) {
  return std::move(ModelDecl<Llama>(std::move(name), std::move(doc))
                       .args(std::move(args))
                       .check(check_llama_args)
                       .build(build_llama)
                       .pipeline(&Llama::pieces)
                       .context_parallel(&Llama::slot, check_llama_cp)
                       .tp_plan(llama_tp_plan, check_llama_tp)
                       .logits("output")
                       .experts([](const ModelArgs& a) { return a.i("n_experts"); })
                       .hf(std::move(hf)));
}

// Qwen3's defaults: the q and k norms on, RMSNorm epsilon 1e-6.
std::vector<ArgSpec> qwen3_args() {
  std::vector<ArgSpec> args = llama_args();
  for (ArgSpec& a : args) {
    a.quiet_default = false;  // llama's later arguments; qwen3's configs list every one
    if (a.name == "qk_norm") a.default_value = true;
    if (a.name == "norm_eps") a.default_value = 1e-6;
  }
  return args;
}

}  // namespace

std::vector<ModelSpec> llama_specs() {
  return {decoder_decl("llama", "Llama-style Transformer (torchtitan): RMSNorm, RoPE, grouped-query attention, SwiGLU",
                       llama_args(), llama_hf_adapter()),
          decoder_decl("qwen3", "Qwen3: llama's decoder with an RMSNorm of each query and key head before the rotary",
                       qwen3_args(), qwen3_hf_adapter())};
}

}  // namespace composer::models

// The Llama-style transformer of torchtitan (docs/scenarios.md M14): RMSNorm, rotary
// position embeddings, grouped-query attention (n_kv_heads), SwiGLU
// feed-forward, blocks named layers.0 .. layers.<n-1>, depth-scaled init.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "models/latent_attention.h"
#include "models/layers.h"
#include "models/model_decl.h"
#include "models/moe.h"
#include "models/rope.h"

namespace composer::models {

// Whether layer `layer` of a llama (or qwen3) with `a` has a routed
// feed-forward: n_experts, past the first n_dense_layers, every
// moe_layer_step-th layer, and not one of dense_layers.
bool llama_routed_layer(const ModelArgs& a, int64_t layer);

namespace {

using nn::Linear;

// An argument that only some of the decoder's models declare (deepseek_v3 has
// no head_dim, n_kv_heads or qk_norm; llama and qwen3 no latent attention).
int64_t int_or(const ModelArgs& a, const char* name, int64_t fallback) {
  return a.values().count(name) ? a.i(name) : fallback;
}
bool has_qk_norm(const ModelArgs& a) { return a.values().count("qk_norm") && a.b("qk_norm"); }
bool latent_attention(const ModelArgs& a) { return int_or(a, "kv_lora_rank", 0) > 0; }

struct LlamaArgs {
  int64_t dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of, max_seq_len, hidden_dim;
  double ffn_dim_multiplier, norm_eps;
  bool depth_init, weight_tying;
  MoeArgs moe;  // moe.experts 0: every block's feed-forward is dense
  ModelArgs args;  // every argument: the rotary scaling (models/rope.h), which layers route (llama_routed_layer)
  int64_t head_dim_given = 0;  // 0: dim / n_heads
  bool qk_norm = false;        // Qwen3's per-head RMSNorm of q and k before the rotary
  LatentAttentionArgs mla;     // DeepSeek-V3's latent attention in place of Attention when kv_lora_rank > 0
  bool latent() const { return mla.kv_lora_rank > 0; }
  int64_t rope_dim() const { return latent() ? mla.qk_rope_head_dim : head_dim(); }
  int64_t head_dim() const { return head_dim_given > 0 ? head_dim_given : dim / n_heads; }
  int64_t ffn_hidden() const {
    if (hidden_dim > 0) return hidden_dim;  // given (a Hugging Face intermediate_size)
    int64_t hidden = 2 * (4 * dim) / 3;
    if (ffn_dim_multiplier > 0) hidden = static_cast<int64_t>(ffn_dim_multiplier * hidden);
    return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
  }
};

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
    auto [cos, sin] = rope_rows(*slot_, cos_, sin_, b, s, x.device());
    const torch::Tensor& docs = slot_->doc_start();
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
    if (a.latent()) {
      mla = add("attention", std::make_shared<LatentAttention>(a.mla, std::move(slot)));
    } else {
      attention = add("attention", std::make_shared<Attention>(a, std::move(slot)));
    }
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
    if (attention) {
      for (auto* w : {&attention->wq->weight, &attention->wk->weight, &attention->wv->weight}) {
        nn::init_param(*w, trunc_normal(0.02));
      }
      nn::init_param(attention->wo->weight, trunc_normal(std));
    } else {  // torchtitan's DeepSeek-V3: every projection at 0.02 but the output's, depth-scaled
      for (const auto& l : {mla->wq, mla->wq_a, mla->wq_b, mla->wkv_a, mla->wkv_b}) {
        if (l) nn::init_param(l->weight, trunc_normal(0.02));
      }
      nn::init_param(mla->wo->weight, trunc_normal(std));
    }
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
  void set_rope(const torch::Tensor& cos, const torch::Tensor& sin) {
    if (attention) attention->set_rope(cos, sin);
    if (mla) mla->set_rope(cos, sin);
  }
  torch::Tensor forward(torch::Tensor x) override {
    auto normed = (*attention_norm)(x);
    auto h = x + (attention ? (*attention)(normed) : (*mla)(normed));
    auto n = (*ffn_norm)(h);
    return h + (feed_forward ? (*feed_forward)(n) : (*moe)(n));
  }
  std::shared_ptr<Attention> attention;
  std::shared_ptr<LatentAttention> mla;       // or DeepSeek-V3's (model.args.kv_lora_rank)
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
    auto [cos, sin] = rope_tables(a.args, a.rope_dim(), 2 * a.max_seq_len);
    cos = cos.to(nn::buffer_options().device());
    sin = sin.to(nn::buffer_options().device());
    for (int64_t i = 0; i < a.n_layers; ++i) {
      auto block = std::make_shared<TransformerBlock>(i, a, slot_);
      block->set_rope(cos, sin);
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

// Llama's and Qwen3's attention: head_dim, n_kv_heads.
void check_head_args(const ModelArgs& a) {
  if (a.i("head_dim") < 0) throw ArgError("head_dim", "head_dim must be 0 (dim / n_heads) or positive");
  if (a.i("head_dim") == 0) require_arg_divides(a, "n_heads", "dim");
  if (a.i("head_dim") == 0 && (a.i("dim") / a.i("n_heads")) % 2 != 0) {
    throw ArgError("n_heads", "head_dim dim/n_heads must be even for rotary embeddings");
  }
  if (a.i("head_dim") % 2 != 0) throw ArgError("head_dim", "head_dim must be even for rotary embeddings");
  if (a.i("n_kv_heads") < 0 || (a.i("n_kv_heads") > 0 && a.i("n_heads") % a.i("n_kv_heads") != 0)) {
    throw ArgError("n_kv_heads", "n_kv_heads " + std::to_string(a.i("n_kv_heads")) + " does not divide n_heads " +
                                     std::to_string(a.i("n_heads")) + "; use 0 or a divisor of n_heads");
  }
}

// DeepSeek-V3's latent attention.
void check_latent_args(const ModelArgs& a) {
  for (auto n : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}) require_arg_positive(a, n);
  if (a.i("q_lora_rank") < 0) {
    throw ArgError("q_lora_rank", "q_lora_rank must be 0 (the query straight from the input) or positive");
  }
  if (a.i("qk_rope_head_dim") % 2 != 0) {
    throw ArgError("qk_rope_head_dim", "qk_rope_head_dim must be even for rotary embeddings");
  }
  if (a.i("v_head_dim") > a.i("qk_nope_head_dim") + a.i("qk_rope_head_dim")) {
    throw ArgError("v_head_dim", "v_head_dim " + std::to_string(a.i("v_head_dim")) +
                                     " is wider than a query head (qk_nope_head_dim + qk_rope_head_dim " +
                                     std::to_string(a.i("qk_nope_head_dim") + a.i("qk_rope_head_dim")) +
                                     "), which context_parallel's attention does not take; use at most that");
  }
}

// dense_layers: the layer indices, comma-separated ("1, 3"), each once and below n_layers; throws ArgError.
std::vector<int64_t> dense_layer_list(const ModelArgs& a) {
  std::vector<int64_t> layers;
  std::stringstream in(a.s("dense_layers"));
  for (std::string item; std::getline(in, item, ',');) {
    const auto first = item.find_first_not_of(' '), last = item.find_last_not_of(' ');
    const std::string digits = first == std::string::npos ? "" : item.substr(first, last - first + 1);
    const bool number = !digits.empty() && digits.size() < 10 &&
                        digits.find_first_not_of("0123456789") == std::string::npos;
    const int64_t layer = number ? std::stoll(digits) : -1;
    if (layer < 0 || layer >= a.i("n_layers") ||
        std::find(layers.begin(), layers.end(), layer) != layers.end()) {
      throw ArgError("dense_layers", "dense_layers \"" + a.s("dense_layers") + "\": \"" + digits +
                                         "\" is not a layer index from 0 to n_layers - 1 (" +
                                         std::to_string(a.i("n_layers") - 1) + ") given once; write the dense "
                                         "layers' indices separated by commas, e.g. \"0, 2\"");
    }
    layers.push_back(layer);
  }
  return layers;
}

// Which layers route: n_dense_layers, moe_layer_step, dense_layers; none without experts.
void check_routed_layers(const ModelArgs& a) {
  if (a.i("n_experts") == 0) {
    const std::pair<const char*, bool> set[] = {{"n_dense_layers", a.i("n_dense_layers") != 0},
                                                {"moe_layer_step", a.i("moe_layer_step") != 1},
                                                {"dense_layers", !a.s("dense_layers").empty()},
                                                {"n_group", a.i("n_group") != 1},
                                                {"topk_group", a.i("topk_group") != 1},
                                                {"expert_bias", a.b("expert_bias")},
                                                {"grouped_mm", !a.b("grouped_mm")}};
    for (const auto& [n, given] : set) {
      if (given) {
        throw ArgError(n, std::string(n) + " is an argument of a mixture of experts; this model has n_experts 0: "
                                           "remove it or set n_experts");
      }
    }
    return;
  }
  if (a.i("moe_layer_step") < 1) throw ArgError("moe_layer_step", "moe_layer_step must be 1 (every layer) or more");
  dense_layer_list(a);
  bool any = false;
  for (int64_t i = 0; i < a.i("n_layers"); ++i) any = any || llama_routed_layer(a, i);
  if (a.i("n_dense_layers") < 0 || !any) {
    throw ArgError("n_dense_layers", "n_dense_layers " + std::to_string(a.i("n_dense_layers")) + ", moe_layer_step " +
                                         std::to_string(a.i("moe_layer_step")) + " and dense_layers \"" +
                                         a.s("dense_layers") + "\" leave no layer of " +
                                         std::to_string(a.i("n_layers")) + " routed (or n_dense_layers is negative); "
                                         "route at least one, or set n_experts: 0");
  }
}

// Group-limited routing: n_group groups of two or more experts, topk_group of them holding top_k experts.
void check_groups(const ModelArgs& a) {
  const int64_t n = a.i("n_experts"), groups = a.i("n_group"), kept = a.i("topk_group");
  if (groups < 1 || n % groups != 0 || (groups > 1 && n / groups < 2)) {
    throw ArgError("n_group", "n_group " + std::to_string(groups) + " must divide n_experts " + std::to_string(n) +
                                  " into groups of at least 2 experts (1: no groups)");
  }
  if (kept < 1 || kept > groups || kept * (n / groups) < a.i("top_k")) {
    throw ArgError("topk_group", "topk_group " + std::to_string(kept) + " must be between 1 and n_group " +
                                     std::to_string(groups) + ", and its groups hold top_k " +
                                     std::to_string(a.i("top_k")) + " experts or more");
  }
}

void check_routing_args(const ModelArgs& a) {
  if (a.i("top_k") < 1 || a.i("top_k") > a.i("n_experts")) {
    throw ArgError("top_k", "top_k " + std::to_string(a.i("top_k")) + " must be between 1 and n_experts " +
                                std::to_string(a.i("n_experts")) + "; route each token to at most every expert");
  }
  check_groups(a);
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

void check_llama_args(const ModelArgs& a) {
  for (auto n : {"dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"}) {
    require_arg_positive(a, n);
  }
  if (a.values().count("kv_lora_rank")) {
    check_latent_args(a);
  } else {
    check_head_args(a);
  }
  check_rope_args(a);
  if (a.i("hidden_dim") < 0) throw ArgError("hidden_dim", "hidden_dim must be 0 (derived) or positive");
  if (a.i("n_experts") < 0) throw ArgError("n_experts", "n_experts must be 0 (a dense feed-forward) or positive");
  check_routed_layers(a);
  if (a.i("n_experts") > 0) check_routing_args(a);
}

std::shared_ptr<Llama> build_llama(const ModelArgs& a) {
  const int64_t kv = int_or(a, "n_kv_heads", 0);
  LlamaArgs l{a.i("dim"),
              a.i("n_layers"),
              a.i("n_heads"),
              kv ? kv : a.i("n_heads"),
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
                      a.f("bias_update_rate"), a.f("capacity_factor"), a.f("z_loss_coeff"), a.i("n_group"),
                      a.i("topk_group"), a.b("expert_bias"), a.b("grouped_mm")},
              a,
              int_or(a, "head_dim", 0),
              has_qk_norm(a)};
  if (latent_attention(a)) {
    l.mla = {a.i("dim"),        a.i("n_heads"),          a.i("q_lora_rank"),          a.i("kv_lora_rank"),
             a.i("qk_nope_head_dim"), a.i("qk_rope_head_dim"), a.i("v_head_dim"), rope_softmax_scale(a)};
  }
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
  if (latent_attention(a)) {
    // torchtitan's DeepSeek-V3 plan: whole heads of the query and of the expanded latent on each rank,
    // the latent projections and their norms replicated. Their gradients are whole (the colwise
    // Linears sum their inputs' gradients over tp), but for the rotary key every head shares.
    for (auto w : {a.i("q_lora_rank") ? "attention.wq_b" : "attention.wq", "attention.wkv_b"}) {
      p.push_back(colwise(std::string("layers.*.") + w));
    }
    p.push_back(shared_input("layers.*.attention.k_rope"));
  } else {
    for (auto w : {"attention.wq", "attention.wk", "attention.wv"}) p.push_back(colwise(std::string("layers.*.") + w));
  }
  // Qwen3's q and k norms act on each rank's own heads: their weights' gradients are partial sums over tp.
  if (has_qk_norm(a)) {
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
  const int64_t kv = int_or(a, "n_kv_heads", 0) ? a.i("n_kv_heads") : a.i("n_heads");
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
                 quiet(string_arg("dense_layers", "",
                                  "mixture of experts: these layers keep a dense feed-forward, their indices "
                                  "separated by commas, e.g. \"0, 2\" (Qwen3-MoE's mlp_only_layers); \"\" is none")),
                 int_arg("n_experts", 0, "routed experts in every block's feed-forward (mixture of experts); 0 is dense"),
                 quiet(int_arg("n_group", 1,
                               "mixture of experts: the experts in this many groups; each token routes within its "
                               "topk_group best groups (DeepSeek-V3); 1 is no groups")),
                 quiet(int_arg("topk_group", 1, "mixture of experts: the groups each token routes within")),
                 quiet(bool_arg("expert_bias", false,
                                "mixture of experts: a selection bias per expert even when bias_update_rate is 0 "
                                "(DeepSeek-V3's e_score_correction_bias)")),
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
                 float_arg("z_loss_coeff", 0.0, "router z-loss coefficient (per sequence, ST-MoE); 0 is none"),
                 quiet(bool_arg("grouped_mm", true,
                                "mixture of experts: each expert projection one grouped product over every "
                                "expert's rows (at::_grouped_mm; on CUDA in bfloat16); false: one product per "
                                "expert. The same values on the CPU"))};
  const std::vector<ArgSpec> rope = rope_args();
  args.insert(args.begin() + 8, rope.begin(), rope.end());  // after norm_eps, where rope_theta stood
  return args;
}

}  // namespace

bool llama_routed_layer(const ModelArgs& a, int64_t layer) {
  if (a.i("n_experts") == 0 || layer < a.i("n_dense_layers") || (layer + 1) % a.i("moe_layer_step") != 0) return false;
  if (a.s("dense_layers").empty()) return true;
  const std::vector<int64_t> dense = dense_layer_list(a);
  return std::find(dense.begin(), dense.end(), layer) == dense.end();
}

std::shared_ptr<const HfAdapter> llama_hf_adapter();  // llama_hf.cpp
std::shared_ptr<const HfAdapter> qwen3_hf_adapter();  // llama_hf.cpp
std::shared_ptr<const HfAdapter> deepseek_v3_hf_adapter();  // deepseek_hf.cpp

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

bool group_routing_arg(const std::string& name) {
  return name == "n_group" || name == "topk_group" || name == "expert_bias";
}

// Arguments every family keeps quiet at their defaults, so that configs written before them keep their hashes.
bool quiet_everywhere(const std::string& name) { return name == "dense_layers" || name == "grouped_mm"; }

// Qwen3's defaults: the q and k norms on, RMSNorm epsilon 1e-6.
std::vector<ArgSpec> qwen3_args() {
  std::vector<ArgSpec> args = llama_args();
  for (ArgSpec& a : args) {
    // llama's later arguments; qwen3's configs list every one but DeepSeek-V3's routing, which Qwen3 lacks,
    // and dense_layers (quiet where unused, so that configs written before it keep their hashes)
    if (!group_routing_arg(a.name) && !quiet_everywhere(a.name)) a.quiet_default = false;
    if (a.name == "qk_norm") a.default_value = true;
    if (a.name == "norm_eps") a.default_value = 1e-6;
  }
  return args;
}

// DeepSeek-V3's: llama's with the latent attention in place of head_dim,
// n_kv_heads and qk_norm, and its routing's defaults (sigmoid scores, the top
// k's weights divided by their sum).
std::vector<ArgSpec> deepseek_v3_args() {
  std::vector<ArgSpec> args;
  for (ArgSpec& a : llama_args()) {
    if (a.name == "head_dim" || a.name == "n_kv_heads" || a.name == "qk_norm") continue;
    if (a.name.rfind("rope_", 0) != 0 && !quiet_everywhere(a.name)) a.quiet_default = false;
    if (a.name == "norm_eps") a.default_value = 1e-6;
    if (a.name == "score_func") a.default_value = std::string("sigmoid");
    if (a.name == "route_norm") a.default_value = true;
    const bool heads = a.name == "n_heads";
    args.push_back(std::move(a));
    if (!heads) continue;
    for (ArgSpec latent : {int_arg("q_lora_rank", 0, "the query's latent width; 0: the query straight from the input"),
                           int_arg("kv_lora_rank", 64, "the key/value latent's width"),
                           int_arg("qk_nope_head_dim", 32, "each query and key head's width without rotary"),
                           int_arg("qk_rope_head_dim", 16,
                                   "each query head's rotated width, and the rotary key's that every head shares"),
                           int_arg("v_head_dim", 32, "each value head's width")}) {
      args.push_back(std::move(latent));
    }
  }
  return args;
}

}  // namespace

std::vector<ModelSpec> llama_specs() {
  return {decoder_decl("llama", "Llama-style Transformer (torchtitan): RMSNorm, RoPE, grouped-query attention, SwiGLU",
                       llama_args(), llama_hf_adapter()),
          decoder_decl("qwen3", "Qwen3: llama's decoder with an RMSNorm of each query and key head before the rotary",
                       qwen3_args(), qwen3_hf_adapter()),
          decoder_decl("deepseek_v3",
                       "DeepSeek-V3: llama's decoder with multi-head latent attention and group-limited sigmoid routing",
                       deepseek_v3_args(), deepseek_v3_hf_adapter())};
}

}  // namespace composer::models

// The cost model of `composer suggest`: a plan's step on one rank, term by
// term, from the model's shapes, the plan and the machine's measured rates
// (runner/suggest/probe.h). docs/memory.md#searching-plans-composer-suggest
// gives every term's formula.
#include <algorithm>
#include <cmath>

#include "runner/suggest/search.h"
#include "runner/train/optim.h"

namespace composer::suggest_detail {
namespace {

// Bytes read and written per element by the memory-bound ops of a layer's
// forward and backward together (the forward a third of them), per width:
// two norms and two residual adds on the model's width, the rotary embedding
// and head layouts on the query/key/value widths, SwiGLU's activation and
// product on the feed-forward width; the loss's softmax on the logits; an MoE
// layer's dispatch and combine copies on each routed token's width.
constexpr double kModelWidthPasses = 30, kHeadPasses = 10, kFfnPasses = 15, kLogitPasses = 8, kRoutePasses = 12;
// Ops a layer runs per microbatch, forward and backward; a routed layer adds its routing's and each local
// expert's; the step adds
// the embedding's, the loss's and the optimizer's per-parameter ops.
constexpr double kLayerOps = 90, kRoutedOps = 40, kExpertOps = 20, kStepOps = 40, kOptimizerOpsPerTensor = 12;

struct Local {
  double n, e, tokens, mb, layers, tp;  // tokens: one microbatch's on this rank, before sequence parallelism
  double recompute_all, recompute_elementwise;  // the fraction of the forward repeated: every op; only memory-bound ones
};

Local local_of(const Shape& s, const ModelFacts& f, const ExperimentConfig& c, const World& w) {
  Local l;
  l.n = static_cast<double>(w.size());
  const bool half = w.cuda && s.precision != Precision::kAsGiven;
  l.e = half ? 2.0 : static_cast<double>(c10::elementSize(scalar_type_of(c.train.dtype)));
  l.mb = static_cast<double>(s.microbatches);
  l.tokens = static_cast<double>(c.train.global_batch) * static_cast<double>(f.seq) /
             static_cast<double>(s.batch_split() * s.cp) / l.mb;
  l.layers = static_cast<double>(s.busiest_layers(f.layers));
  l.tp = static_cast<double>(s.tp);
  const double checkpointed = s.ac == Ac::kNone ? 0.0 : 1.0 / static_cast<double>(s.ac_every);
  l.recompute_all = s.ac == Ac::kFull ? checkpointed / 3.0 : 0.0;  // the forward is a third of forward + backward
  l.recompute_elementwise = s.ac == Ac::kNone ? 0.0 : checkpointed / 3.0;
  return l;
}

double precision_factor(const Shape& s, const World& w) {
  if (!w.cuda) return 1.0;
  switch (s.precision) {
    case Precision::kAsGiven: return 0.125;  // float32 without tensor cores
    case Precision::kBf16: return 1.0;
    default: return 1.5;                     // float8's matmuls, its casts aside
  }
}

void compute_terms(StepTerms& t, const Shape& s, const ModelFacts& f, const ExperimentConfig& c, World& w,
                   const Local& l) {
  const double global_tokens = static_cast<double>(c.train.global_batch) * static_cast<double>(f.seq);
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(l.tokens));
  const int64_t k = std::max<int64_t>(1, f.dim), n = std::max<int64_t>(1, f.dim / s.tp);
  // a linear layer's three products: the forward (rows x k by k x n), the input's gradient (rows x n
  // by n x k) and the weight's (k x rows by rows x n), each a third of its FLOPs
  t.rate = 3.0 / (1.0 / w.rates.matmul_rate(rows, k, n) + 1.0 / w.rates.matmul_rate(rows, n, k) +
                  1.0 / w.rates.matmul_rate(k, rows, n)) *
           precision_factor(s, w);
  double linear = 6 * (f.matrix_params - f.expert_matrix) * global_tokens / l.n / t.rate;
  if (f.expert_matrix > 0) {  // each routed expert multiplies its own rows: top_k x tokens spread over the experts
    const int64_t rows_each = std::max<int64_t>(1, static_cast<int64_t>(l.tokens * f.top_k * s.ep / f.experts));
    const int64_t h = std::max<int64_t>(1, f.expert_hidden);
    const double rate = 3.0 / (1.0 / w.rates.matmul_rate(rows_each, k, h) + 1.0 / w.rates.matmul_rate(rows_each, h, k) +
                               1.0 / w.rates.matmul_rate(k, rows_each, h)) *
                        precision_factor(s, w);
    linear += 6 * f.expert_matrix * global_tokens / l.n * l.tp / rate;  // whole on every tp rank: each computes them
  }
  double attention = 0;
  if (f.attention) {  // causal: half the scores
    const double rate = w.rates.matmul_rate(rows, std::max<int64_t>(1, f.head_dim), std::max<int64_t>(1, f.seq / s.cp)) *
                        precision_factor(s, w);
    attention = 6.0 * f.layers * f.attn_dim * f.seq * global_tokens / l.n / rate;
  }
  t.matmul_s = (linear + attention) * (1 + l.recompute_all);
  const double sp = s.tp > 1 && s.tp_style < 2 ? l.tp : 1.0;  // sequence parallelism splits the norms' tokens
  const double heads_width = (f.attn_dim + 2.0 * f.kv_dim) / l.tp;
  // the routed experts' width is whole on every tp rank; the rest of the feed-forward splits
  const double routed_width = f.layers > 0 ? f.expert_matrix / (3.0 * f.dim * f.layers) : 0.0;
  double per_layer = kModelWidthPasses * f.dim / sp + kHeadPasses * heads_width +
                     kFfnPasses * ((f.ffn_per_token - routed_width) / l.tp + routed_width);
  if (f.moe_layers > 0) per_layer += kRoutePasses * f.top_k * f.dim * f.moe_layers / std::max<double>(1, f.layers);
  const double logits = kLogitPasses * f.vocab / (s.tp > 1 && s.tp_style == 0 ? l.tp : 1.0);
  const double bytes = l.e * l.tokens * l.mb * (l.layers * per_layer * (1 + l.recompute_elementwise) + logits);
  t.elementwise_s = bytes / w.rates.elementwise_bytes_per_s;
  // a routed layer: its routing's ops, and each expert the rank holds its own products' and activation's
  const double local_experts = static_cast<double>(f.experts) / static_cast<double>(s.ep);
  const double routed = f.moe_layers > 0 ? (kRoutedOps + kExpertOps * local_experts) * f.moe_layers / std::max<double>(1, f.layers) : 0.0;
  t.kernels_s = l.mb * (l.layers * (kLayerOps + routed) * (1 + l.recompute_elementwise) + kStepOps) * w.rates.kernel_s;
  t.recompute_s = (linear + attention) * l.recompute_all +
                  l.e * l.tokens * l.mb * l.layers * per_layer * l.recompute_elementwise / w.rates.elementwise_bytes_per_s;
}

// The ranks fully_shard (or HSDP's shard dim) splits each parameter over; 1 without.
double shard_ranks(const Shape& s) {
  return s.dp_mode == DpMode::kFullyShard ? static_cast<double>(s.dp * s.cp)
         : s.dp_mode == DpMode::kHsdp     ? static_cast<double>(s.shard)
                                          : 1.0;
}

// The elements of the rank's parameters the optimizer steps: the experts split by expert_parallel, everything
// by tp and pp, and by fully_shard's ranks.
double local_elements(const Shape& s, const ModelFacts& f, const Local& l) {
  const double shard = shard_ranks(s);
  const double expert_shard = s.ep_borrows_dp ? static_cast<double>(s.ep) : static_cast<double>(s.ep) * shard;
  return ((f.param_bytes - f.expert_bytes) / (l.tp * s.pp * shard) + f.expert_bytes / (expert_shard * s.pp)) / l.e;
}

// The work a step does on each parameter element besides the matmuls, as this config trains: the gradient
// written into fresh memory (gradients are set to none every step), the gradient norm, clipping where set,
// and the optimizer's update (its states' reads and writes, its kernels' own passes). The probe measures
// it per optimizer on four tensors (MachineRates::per_element_s); Muon (its Newton-Schulz products depend
// on the matrices' shapes) and rates without a measurement are priced by the bytes each element's update
// reads and writes. The probe's fill of the fresh gradient is one write the backward's own product also
// makes in the matmul term: counted twice, a small share of either.
double element_step_s(const ExperimentConfig& c, World& w) {
  const OptimizerConfig& o = c.train.optimizer;
  const bool adam = o.name == OptimizerKind::kAdam || o.name == OptimizerKind::kAdamW;
  const double bytes_per = 4.0 * ((adam ? 7 : 5) + 2);  // the parameter and its states read and written; the norm
  if (o.name == OptimizerKind::kMuon) return bytes_per / w.rates.elementwise_bytes_per_s;
  const bool sgd = o.name == OptimizerKind::kSgd;
  std::string what = std::string(sgd ? "sgd" : adam && o.name == OptimizerKind::kAdam ? "adam" : "adamw") +
                     (sgd && o.momentum > 0 ? " momentum" : "") +
                     (o.weight_decay > 0 ? " decay" : "") + (c.train.grad_clip > 0 ? " clip" : "") + " step";
  const double clip = c.train.grad_clip;
  const double s = w.rates.per_element_s(what, [&o, clip](int64_t elements) {
    auto params = std::make_shared<std::vector<torch::Tensor>>();
    for (int i = 0; i < 4; ++i) params->push_back(torch::randn({elements / 4}).requires_grad_());
    std::shared_ptr<Optimizer> opt = make_optimizer(o, *params);
    return std::function<void()>([params, opt, clip] {
      for (auto& p : *params) p.mutable_grad() = torch::empty_like(p).fill_(1e-3);
      const double norm = grad_norm(*params);
      if (clip > 0) clip_grads(*params, norm, clip);
      opt->step();
    });
  });
  return s > 0 ? s : bytes_per / w.rates.elementwise_bytes_per_s;
}

void optimizer_term(StepTerms& t, const Shape& s, const ModelFacts& f, const ExperimentConfig& c, World& w,
                    const Local& l) {
  t.optimizer_s = local_elements(s, f, l) * element_step_s(c, w) +
                  static_cast<double>(f.tensors) / static_cast<double>(s.pp) * kOptimizerOpsPerTensor * w.rates.kernel_s;
}

// A group of `span` ranks, tp innermost in the mesh [pp, dp, ep, cp, tp]: inside a node when they fit in one.
LinkCost link_for(const World& w, int64_t group, int64_t span) {
  return w.rates.link(group, span <= w.ranks_per_node);
}

// An all-reduce (Gloo's own, not a ring of composer's) over such a group.
LinkCost reduce_for(World& w, int64_t group, int64_t span) {
  return w.rates.native(MachineRates::Collective::kAllReduce, group, span <= w.ranks_per_node);
}

// A collective's time (LinkCost::seconds), its latency part kept apart for the refit.
double charge(StepTerms& t, const LinkCost& link, double calls, double bytes) {
  t.comm_latency_s += calls * link.latency_s;
  t.calls += calls;
  t.sent_bytes += bytes;
  return link.seconds(calls, bytes);
}

void tp_cp_terms(StepTerms& t, const Shape& s, const ModelFacts& f, World& w, const Local& l) {
  const double again = 1 + 3 * l.recompute_all;  // a repeated forward repeats its collectives (a third of the calls)
  const double activation = l.tokens * f.dim * l.e;
  if (s.tp > 1) {
    const double share = (l.tp - 1) / l.tp;
    double calls = 0, bytes = 0, extra_calls = 0, extra_bytes = 0;
    if (s.tp_style < 2) {
      // sequence parallel, per layer: the attention's and the feed-forward's inputs gathered and their
      // outputs reduce-scattered, and each again in the backward; the embedding's output scattered and
      // the output layer's input gathered, and each again in the backward; a step's one all-reduce of the
      // norms' weight gradients (each rank's tokens' partial sums)
      calls = l.layers * l.mb * 8.0 * again;
      bytes = calls * share * activation;
      extra_calls = 4 * l.mb + 1;
      extra_bytes = 4 * l.mb * share * activation + 2 * share * (2 * l.layers + 1) * f.dim * l.e;
    } else {
      // plain, per layer: the attention's output projection and a split feed-forward's down projection
      // all-reduce their outputs, and each column-split projection (query, key and value, or latent
      // attention's two; a split feed-forward's gate and up) all-reduces its input's gradient in the
      // backward; the embedding all-reduces its output and the output layer its input's gradient
      const double attention_inputs = f.latent_attention ? 2.0 : 3.0;
      calls = l.layers * l.mb * (1 + f.split_ffn_share + attention_inputs + 2 * f.split_ffn_share) * again;
      extra_calls = 2 * l.mb;
      bytes = (calls + extra_calls) * 2 * share * activation;
    }
    // sequence parallelism's gathers and reduce-scatters are rings; plain tensor parallelism's all-reduces
    // Gloo's own, as are loss parallelism's
    const LinkCost link = s.tp_style < 2 ? link_for(w, s.tp, s.tp) : reduce_for(w, s.tp, s.tp);
    t.tp_s = charge(t, link, calls + extra_calls, bytes + extra_bytes);
    if (s.tp_style == 0) {  // loss parallel: the softmax's maximum, then its sum and the target's logit together
      t.tp_s += charge(t, reduce_for(w, s.tp, s.tp), 2 * l.mb, l.mb * 2 * share * 3 * l.tokens * 4);
    } else {  // the logits gathered
      t.tp_s += charge(t, link_for(w, s.tp, s.tp), l.mb, l.mb * share * l.tokens * f.vocab * l.e);
    }
  }
  if (s.cp > 1) {
    const double cp = static_cast<double>(s.cp), kv = 2.0 * l.tokens * f.kv_dim / l.tp * l.e;
    double calls = 0, bytes = 0;
    const double grads = kv / l.e * 4;  // the blocks' gradients travel in float32
    // The ring: each block forward and again backward (cp - 1 steps each), and the gradients a full turn
    // (cp steps). allgather: the blocks gathered forward and again backward, their gradients
    // reduce-scattered.
    if (s.rotate == 0) calls = 3 * cp - 2, bytes = 2 * (cp - 1) * kv + cp * grads;
    else if (s.rotate == 1) calls = 3, bytes = (cp - 1) * (2 * kv + grads);
    else calls = 8, bytes = 8 * (cp - 1) / cp * l.tokens * f.attn_dim / l.tp * l.e;  // q, k, v and the output, both ways
    const LinkCost link = s.rotate == 2 ? w.rates.native(MachineRates::Collective::kAllToAll, s.cp,
                                                         s.cp * s.tp <= w.ranks_per_node)
                                        : link_for(w, s.cp, s.cp * s.tp);
    t.cp_s = charge(t, link, calls * l.layers * l.mb * again, bytes * l.layers * l.mb * again);
  }
}

// Of replicate's all-reduces (`comm_s` for `bytes` of gradients), the time hidden behind the last
// microbatch's backward (`backward_s`): each 25 MB bucket is all-reduced as soon as backward has
// written its gradients, the last parameters' first (parallelisms/grad_sync.h), one after another; the
// buckets fill at the backward's pace, each after its share of the bytes. What runs past the backward's
// end is waited for.
double replicate_hidden_s(double comm_s, double bytes, double backward_s) {
  const double bucket = 25.0 * 1024 * 1024;
  const int n = std::max(1, static_cast<int>(std::ceil(bytes / bucket)));
  double done = 0;
  for (int i = 1; i <= n; ++i) done = std::max(done, backward_s * std::min(1.0, i * bucket / bytes)) + comm_s / n;
  return std::clamp(comm_s - (done - backward_s), 0.0, comm_s);
}

void dp_terms(StepTerms& t, const Shape& s, const ModelFacts& f, World& w, const Local& l) {
  const double dense = (f.param_bytes - f.expert_bytes) / (l.tp * s.pp);  // a rank's unsharded non-expert bytes
  const double experts = f.expert_bytes / (static_cast<double>(s.ep) * s.pp);
  const double gather_e = w.cuda && s.precision != Precision::kAsGiven ? 0.5 : 1.0;  // bfloat16 gathers
  const int64_t ep_here = s.ep_borrows_dp ? 1 : s.ep;
  const int64_t copies = s.dp * s.cp * ep_here;  // ranks holding the same non-expert parameters
  // fully_shard's units on a rank: its layers, the embedding and the output (a pipeline stage holds one of
  // the two at the most)
  const double units =
      static_cast<double>(std::max<int64_t>(1, s.busiest_layers(f.layers)) + (s.pp > 1 ? 1 : 2));
  auto ring = [](double g) { return (g - 1) / g; };
  auto send = [&t](const LinkCost& link, double calls, double bytes) {  // a collective, its bytes counted
    t.dp_bytes += bytes;
    return charge(t, link, calls, bytes);
  };
  if (s.dp_mode == DpMode::kReplicate || (s.dp_mode == DpMode::kNone && copies > 1)) {
    // without expert_parallel the experts are copies too
    const double copied = dense + (s.ep == 1 ? experts : 0.0);
    const double g = static_cast<double>(copies), buckets = std::ceil(copied / (25.0 * 1024 * 1024));
    t.dp_s = send(reduce_for(w, copies, copies * s.tp), buckets, 2 * ring(g) * copied);
    double reduced = copied;
    if (s.ep > 1 && s.dp * s.cp > 1 && !s.ep_borrows_dp) {
      t.dp_s += send(reduce_for(w, s.dp * s.cp, s.dp * s.cp * s.tp), std::ceil(experts / (25.0 * 1024 * 1024)),
                     2 * ring(static_cast<double>(s.dp * s.cp)) * experts);
      reduced += experts;
    }
    // a pipeline all-reduces after its last microbatch
    const double last_backward = 2.0 / 3 * (t.matmul_s + t.elementwise_s + t.kernels_s) / l.mb;
    if (s.pp == 1) t.hidden_s = replicate_hidden_s(t.dp_s, reduced, last_backward);
    return;
  }
  if (s.dp_mode == DpMode::kNone) return;
  // All-gathers per unit: one before each microbatch's forward and one before its backward; with
  // reshard_after_forward false one a step, as the unit stays gathered from its first forward to the step's end.
  const double passes = s.keep ? 1.0 : 2.0 * l.mb;
  const int64_t shard = s.dp_mode == DpMode::kHsdp ? s.shard : s.dp * s.cp;
  const double g = static_cast<double>(shard);
  const double weights = dense + (s.ep_borrows_dp ? 0.0 : experts);
  const LinkCost link = link_for(w, shard, shard * s.tp);
  const double gathers = send(link, units * passes, passes * ring(g) * weights * gather_e);
  const double scatters = send(link, units, ring(g) * weights);
  t.dp_s = gathers + scatters;
  // Each unit's all-gather but a pass's first is issued while the unit before it computes (prefetch). On
  // cuda NCCL's streams hide most of them (w.overlap). On cpu only the prefetched gathers' latency is
  // hidden: their copies need the cores the compute has (and take core time from it: the collectives'
  // core time).
  const double prefetched_latency = units * passes * link.latency_s * (units - 1) / units;
  t.hidden_s = std::min(w.cuda ? gathers * w.overlap : prefetched_latency, t.matmul_s);
  if (s.dp_mode == DpMode::kHsdp) {
    const double rep = static_cast<double>(s.dp / s.shard);
    t.dp_s += send(reduce_for(w, s.dp / s.shard, s.dp * s.tp), units, 2 * ring(rep) * weights / g);
  }
  if (!s.ep_borrows_dp && ep_here > 1) {  // non-expert gradients also meet across the ep ranks
    t.dp_s += send(reduce_for(w, ep_here, s.dp * s.cp * ep_here * s.tp), units,
                   2 * ring(static_cast<double>(ep_here)) * dense / g);
  }
  // Experts on the dim fully_shard borrows are split over it alone: copies over cp and HSDP's replicas,
  // their gradients all-reduced there in 25 MB buckets, as replicate's are.
  const int64_t expert_copies = s.cp * (s.dp_mode == DpMode::kHsdp ? s.dp / s.shard : 1);
  if (s.ep_borrows_dp && expert_copies > 1 && f.expert_bytes > 0) {
    const int64_t span = s.dp_mode == DpMode::kHsdp ? s.dp * s.cp * s.tp : s.cp * s.tp;
    const double reduce = send(reduce_for(w, expert_copies, span), std::ceil(experts / (25.0 * 1024 * 1024)),
                               2 * ring(static_cast<double>(expert_copies)) * experts);
    t.dp_s += reduce;
    // bucketed as replicate's (parallelisms/grad_sync.h), beside the last microbatch's backward
    const double last_backward = 2.0 / 3 * (t.matmul_s + t.elementwise_s + t.kernels_s) / l.mb;
    if (s.pp == 1) t.hidden_s += replicate_hidden_s(reduce, experts, last_backward);
  }
}

void pp_ep_terms(StepTerms& t, const Shape& s, const ModelFacts& f, World& w, const Local& l) {
  const double again = 1 + 3 * l.recompute_all;
  if (s.pp > 1) {
    const double sends = 2.0 * l.mb * static_cast<double>(s.virtual_stages);
    t.pp_s = charge(t, link_for(w, 2, w.size()), sends, sends * l.tokens * f.dim * l.e);
  }
  if (s.ep > 1 && f.moe_layers > 0) {
    const double ep = static_cast<double>(s.ep), layers = static_cast<double>(f.moe_layers) / s.pp;
    const double moved = (ep - 1) / ep * l.tokens * f.top_k * f.dim * l.e;  // dispatch or combine, one way
    const int64_t span = s.ep * s.cp * s.tp;  // its own dim or the data-parallel one it borrows: the same ranks
    const LinkCost link = w.rates.native(MachineRates::Collective::kAllToAll, s.ep, span <= w.ranks_per_node);
    t.ep_s = charge(t, link, 5 * layers * l.mb * again, 4 * moved * layers * l.mb * again);
  }
}

// The step's own small collectives, each a latency: the gradient norm's all-reduce over every rank (with
// the step's stop flag), the loss's over the ranks that split the batch, over cp and over the pipeline,
// the pipeline's bubble gathered for the metrics, and a mixture-of-experts model's routing counts over
// the batch's ranks and cp.
void statistics_terms(StepTerms& t, const Shape& s, const ModelFacts& f, World& w, const Local& l) {
  const int64_t n = w.size(), data = s.batch_split();
  auto reduce = [](double g, double bytes) { return 2 * (g - 1) / g * bytes; };  // an all-reduce's ring bytes
  const double counts = f.moe_layers > 0 ? 8.0 * (f.experts + 1) * f.moe_layers / s.pp : 0.0;
  const double loss = 8.0 * (1 + (s.pp > 1 ? l.mb : 0));  // and each microbatch's under a pipeline
  if (n > 1) t.stats_s += charge(t, reduce_for(w, n, n), 1, reduce(static_cast<double>(n), 24));
  if (data > 1) {
    const LinkCost link = reduce_for(w, data, data * s.cp * s.tp);
    t.stats_s += charge(t, link, counts > 0 ? 2 : 1, reduce(static_cast<double>(data), loss + counts));
  }
  if (s.cp > 1) {
    t.stats_s += charge(t, reduce_for(w, s.cp, s.cp * s.tp), counts > 0 ? 2 : 1,
                        reduce(static_cast<double>(s.cp), loss + counts));
  }
  if (s.pp > 1) {
    const double pp = static_cast<double>(s.pp);
    t.stats_s += charge(t, reduce_for(w, s.pp, n), 1, reduce(pp, loss));
    t.stats_s += charge(t, link_for(w, s.pp, n), 1, (pp - 1) * 16);  // the bubble's, gathered by a ring
  }
}

// The optimizer's states per parameter element: Adam's two moments, SGD's momentum, Muon's momentum (AdamW
// for the rest: at least one).
double optimizer_states(const ExperimentConfig& c) {
  switch (c.train.optimizer.name) {
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: return 2;
    case OptimizerKind::kMuon: return 1;
    default: return c.train.optimizer.momentum > 0 ? 1 : 0;
  }
}

// The bytes a layer keeps per token of a microbatch until its backward, at the least. `inputs_only`:
// under full checkpointing, the layer's input. Under mode op, also the outputs of its linear products and attention (query, key, value,
// attention, output projection; gate, up, down). Without checkpointing, what backward reads: each
// norm's input and output, the query, key, value and attention output, the gate's and up
// projection's outputs and their product. `hidden`: the layer's feed-forward width, its routed experts
// aside; `routed`: the rows a token sends them (top_k; 0 in a dense layer).
double kept_per_token(const Shape& s, const ModelFacts& f, double e, double hidden, double routed, bool inputs_only,
                      bool op_mode) {
  const double tp = static_cast<double>(s.tp);
  const double sp = s.tp > 1 && s.tp_style < 2 ? tp : 1.0;
  const double input = f.dim / sp;
  if (inputs_only) return e * input;
  // the query, the attention's output (latent attention: its values' width), the keys and values
  // (latent attention's expanded from its latent: left out)
  const double q = static_cast<double>(f.heads * f.head_dim), out = 2.0 * f.attn_dim - q;
  const double kv = f.heads > 0 && !f.latent_attention ? 2.0 * f.kv_dim : 0.0;
  // Without checkpointing, a routed layer's experts (whole on each tp rank) at the dry run's even routing,
  // `routed` (top_k) rows a token: the dispatched rows, the gate's and up projection's outputs and their
  // product; the experts' output rows in float32 (their weighting's product keeps them for the routing
  // weights' gradient) and the router's float32 scores.
  const double h = static_cast<double>(f.expert_hidden);
  if (op_mode) return e * (3 * input + (q + out + kv + 2 * hidden) / tp);  // the experts' products: not counted
  const double routing = routed > 0 ? 4.0 * (routed * f.dim + static_cast<double>(f.experts)) : 0.0;
  return e * (2 * input + 2 * f.dim / tp + (q + out + kv + 3 * hidden) / tp + routed * (f.dim + 3 * h)) + routing;
}

// The time a pipeline's step takes over its ranks' work alone, less 1, where the node's ranks share
// its cores (`share` below 1). The schedule runs at unit costs (a forward 1, a backward 2, its input and
// weight halves 1 each); each slot takes as long as its active ranks' share of the cores makes it,
// max(1, active / (pp x share)): every active rank progresses at the same rate, so the schedule's order
// holds and only its clock stretches. Against the work at the rate of every rank computing at once
// (work / share), a rank idle in the bubble leaves its core to the ranks still computing. -1 where the
// schedule does not simulate.
double shared_core_stretch(const Shape& s, double share) {
  const auto shape = parallel::shape_for(s.schedule, static_cast<int>(s.pp), static_cast<int>(s.virtual_stages),
                                         static_cast<int>(s.microbatches));
  parallel::ActionCosts costs;
  costs.backward = 2;
  const auto lists = parallel::with_communication(parallel::compute_schedule(s.schedule, shape), shape);
  const parallel::Simulation sim = parallel::simulate(lists, shape, costs);
  if (!sim.ok || sim.makespan <= 0 || sim.compute_slots <= 0) return -1;
  std::vector<int> active(static_cast<size_t>(sim.makespan), 0);
  for (size_t r = 0; r < lists.size(); ++r) {
    std::vector<bool> busy(active.size(), false);
    for (size_t k = 0; k < lists[r].size(); ++k) {
      const parallel::Action& a = lists[r][k];
      int64_t start = sim.start[r][k];
      if (start < 0) continue;
      const int64_t cost = a.op == parallel::Op::kForward ? costs.forward
                           : a.op == parallel::Op::kBackward ? costs.backward
                           : a.op == parallel::Op::kBackwardInput ? costs.input
                                                                  : costs.weight;
      if (a.overlapped) start += costs.forward;  // after its pair's forward
      for (int64_t t = start; t < std::min<int64_t>(start + cost, sim.makespan); ++t) busy[static_cast<size_t>(t)] = true;
    }
    for (size_t t = 0; t < active.size(); ++t) active[t] += busy[t];
  }
  const double pp = static_cast<double>(s.pp);
  double stretched = 0;
  for (int n : active) stretched += std::max(1.0, n / (pp * share));
  const double work = static_cast<double>(sim.compute_slots) / pp;  // a rank's
  return stretched * share / work - 1;
}

// What the first rank's stages hold, per stage: bytes kept per token of one microbatch until its backward,
// the least a backward of it adds (a checkpointed layer's forward again), and its parameters gathered
// whole (fully_shard without resharding after forward keeps them until the backward).
struct StageHold {
  double kept = 0, recompute = 0, gathered = 0;
  double unit = 0;  // its largest fully_shard unit's parameters, whole (a layer, the embedding, the output)
};

StageHold hold_of(const Shape& s, const ModelFacts& f, double e, std::pair<int64_t, int64_t> range) {
  StageHold h;
  const bool fp8 = s.precision == Precision::kFp8Tensorwise;  // mode op keeps composer's own products: not float8's
  double most_saved = 0, least_saved = -1;
  const int64_t len = range.second - range.first;
  for (int64_t i = range.first; i < range.second; ++i) {
    const ModelFacts::Layer& layer = f.per_layer[static_cast<size_t>(i)];
    const double routed = layer.expert_bytes > 0 ? static_cast<double>(f.top_k) : 0.0;
    const double plain = kept_per_token(s, f, e, layer.ffn, routed, false, false);
    const double checkpointed = s.ac == Ac::kNone ? plain
                                : kept_per_token(s, f, e, layer.ffn, routed, s.ac == Ac::kFull || fp8, true);
    h.kept += plain;
    most_saved = std::max(most_saved, plain - checkpointed);
    least_saved = least_saved < 0 ? plain - checkpointed : std::min(least_saved, plain - checkpointed);
    const double whole = layer.bytes / s.tp + (s.ep_borrows_dp ? 0.0 : layer.expert_bytes / (static_cast<double>(s.ep) * s.tp));
    h.gathered += whole;
    h.unit = std::max(h.unit, whole);
  }
  if (s.ac != Ac::kNone) {  // every ac_every-th layer of the stage checkpointed: at the least their largest savings
    h.kept -= static_cast<double>(len / s.ac_every) * most_saved;
    if (s.ac_every == 1 && least_saved > 0) h.recompute = least_saved;
  }
  return h;
}


// What a floor walks: the plan's stages, how their parameters split, and what each element costs.
struct FloorPlan {
  const Shape& s;
  const ModelFacts& f;
  const Local& l;
  double shard = 1, expert_split = 1, per_param = 1, param_e = 1;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // each stage's layers
  parallel::PipelineShape shape;
};

// A stage's parameters on a rank holding it, in bytes, split as evenly as the plan could split them.
double stage_param_bytes(const FloorPlan& p, int stage) {
  const auto k = static_cast<size_t>(stage);
  double dense = stage == 0 ? p.f.first_bytes : 0.0, experts = 0;
  for (int64_t i = p.ranges[k].first; i < p.ranges[k].second; ++i) {
    dense += p.f.per_layer[static_cast<size_t>(i)].bytes;
    experts += p.f.per_layer[static_cast<size_t>(i)].expert_bytes;
  }
  if (stage + 1 == static_cast<int>(p.ranges.size())) dense += p.f.last_bytes;
  return dense / (p.l.tp * p.shard) + experts / p.expert_split;
}

std::vector<int> stages_of(const FloorPlan& p, int rank) {
  return p.s.pp > 1 ? p.shape.stages_of(rank) : std::vector<int>{0};
}

// What pipeline rank `rank` certainly holds at its peak: its stages' parameters and the optimizer's states,
// and the most its schedule `order` holds at once besides. Each forward keeps its stage's activations for one
// microbatch until that microbatch's backward (its input half under the zero-bubble schedules) frees them.
// The gradients are dropped after each optimizer step: a stage's exist from its first backward (its weight
// half under the zero-bubble schedules) on, and all of them at the optimizer step. Under fully_shard each
// unit is whole while it computes (a forward or an input gradient; kept whole already where it does not
// reshard) and its gradients whole until they are reduce-scattered (a backward or a weight gradient): at
// the least the stage's largest unit, beside the other microbatches' activations.
double rank_floor(const FloorPlan& p, int rank, const std::vector<parallel::Action>& order) {
  const Shape& s = p.s;
  std::vector<double> stage_bytes(p.ranges.size(), 0.0);
  std::vector<StageHold> hold(p.ranges.size());
  double held = 0;
  for (int stage : stages_of(p, rank)) {
    const auto k = static_cast<size_t>(stage);
    stage_bytes[k] = stage_param_bytes(p, stage);
    held += stage_bytes[k];
    hold[k] = hold_of(s, p.f, p.l.e, p.ranges[k]);
    if (stage == 0) hold[k].unit = std::max(hold[k].unit, p.f.first_bytes / s.tp);
    if (stage + 1 == static_cast<int>(p.ranges.size())) hold[k].unit = std::max(hold[k].unit, p.f.last_bytes / s.tp);
  }
  // Frozen parameters (train.freeze, train.lora): the layers running them may keep nothing for backward.
  if (p.per_param == 1) return held;
  const bool sharded = s.dp_mode == DpMode::kFullyShard || s.dp_mode == DpMode::kHsdp;
  const bool gathers = sharded && s.keep;
  const double tokens = p.l.tokens;
  std::vector<int> forwards(hold.size(), 0), backwards(hold.size(), 0);
  std::vector<bool> graded(hold.size(), false);
  double kept = 0, grads = 0, most = held;
  for (const parallel::Action& a : order) {
    const auto k = static_cast<size_t>(a.stage);
    const bool frees = a.op == parallel::Op::kBackward || a.op == parallel::Op::kBackwardInput;
    const bool grades = a.op == parallel::Op::kBackward || a.op == parallel::Op::kBackwardWeight;
    if (a.op == parallel::Op::kForward) ++forwards[k], kept += hold[k].kept * tokens;
    double gathered = 0;  // stages run forward and not yet backward
    for (size_t j = 0; j < hold.size(); ++j) {
      if (gathers && forwards[j] > 0 && backwards[j] == 0) gathered += hold[j].gathered * p.param_e;
    }
    most = std::max(most, kept + grads + gathered + (frees ? hold[k].recompute * tokens : 0.0));
    if (sharded && (a.op == parallel::Op::kForward || frees || grades)) {
      // the unit whole beside what the other microbatches keep
      const bool computes = !s.keep && a.op != parallel::Op::kBackwardWeight;
      const double whole = hold[k].unit * p.param_e * ((computes ? 1 : 0) + (grades ? 1 : 0));
      most = std::max(most, kept - hold[k].kept * tokens + grads + gathered + whole);
    }
    if (frees) ++backwards[k], kept -= hold[k].kept * tokens;
    if (grades && !graded[k]) graded[k] = true, grads += stage_bytes[k];
  }
  return held * (p.per_param - 1) + most;
}

}  // namespace

// The most of two pipeline ranks' floors: the first (its stages: the first, and under interleaving every
// pp-th; a V's last too; it warms up with the most microbatches) and the one whose stages hold the most
// parameters (DeepSeek-V3's first stages hold its dense layers).
double memory_floor(const Shape& s, const ModelFacts& f, const ExperimentConfig& c, const World& w) {
  const Local l = local_of(s, f, c, w);
  const bool frozen = !c.train.freeze.empty() || c.train.lora.has_value();
  FloorPlan p{s, f, l};
  p.shard = shard_ranks(s);
  // experts on the dim fully_shard borrows stay split over it alone (replicated over cp where it spans cp)
  p.expert_split = static_cast<double>(s.ep) * l.tp * (s.ep_borrows_dp ? 1.0 : p.shard);
  p.per_param = frozen ? 1 : 2 + optimizer_states(c);  // the parameter, its gradient and the states
  p.param_e = w.cuda && s.precision != Precision::kAsGiven ? 0.5 : 1.0;  // gathered in bfloat16
  if (f.per_layer.empty() || static_cast<int64_t>(f.per_layer.size()) != f.layers) {
    // no layer list: one stage of everything; the parameters, their gradients and the optimizer's states
    return ((f.param_bytes - f.expert_bytes) / (l.tp * p.shard) + f.expert_bytes / p.expert_split) * p.per_param;
  }
  p.ranges = stage_layers(s, f.layers);
  if (s.pp == 1) {  // gradient accumulation: the second microbatch's forward beside the first's gradients
    std::vector<parallel::Action> order;
    for (int64_t m = 0; m < std::min<int64_t>(2, s.microbatches); ++m) {
      order.push_back({parallel::Op::kForward, 0, static_cast<int>(m)});
      order.push_back({parallel::Op::kBackward, 0, static_cast<int>(m)});
    }
    return rank_floor(p, 0, order);
  }
  p.shape = parallel::shape_for(s.schedule, static_cast<int>(s.pp), static_cast<int>(s.virtual_stages),
                                static_cast<int>(s.microbatches));
  const auto lists = parallel::compute_schedule(s.schedule, p.shape);
  int heaviest = 0;
  double most = -1;
  for (int r = 0; r < static_cast<int>(s.pp); ++r) {
    double bytes = 0;
    for (int stage : stages_of(p, r)) bytes += stage_param_bytes(p, stage);
    if (bytes > most * (1 + 1e-9)) most = bytes, heaviest = r;
  }
  double floor = rank_floor(p, 0, lists[0]);
  if (heaviest != 0) floor = std::max(floor, rank_floor(p, heaviest, lists[static_cast<size_t>(heaviest)]));
  return floor;
}

StepTerms price(const Shape& s, const ModelFacts& f, const ExperimentConfig& c, World& w) {
  StepTerms t;
  const Local l = local_of(s, f, c, w);
  compute_terms(t, s, f, c, w, l);
  optimizer_term(t, s, f, c, w, l);
  tp_cp_terms(t, s, f, w, l);
  dp_terms(t, s, f, w, l);
  pp_ep_terms(t, s, f, w, l);
  statistics_terms(t, s, f, w, l);
  t.bubble = s.pp > 1 ? parallel::bubble_formula(
                            s.schedule, parallel::shape_for(s.schedule, static_cast<int>(s.pp),
                                                            static_cast<int>(s.virtual_stages),
                                                            static_cast<int>(s.microbatches)))
                      : 0.0;
  const double share = w.cuda ? 1.0 : w.rates.core_share();
  if (share < 1) t.comm_core_s = t.dp_bytes * w.rates.comm_core_s();
  const double busy = (t.matmul_s + t.elementwise_s + t.kernels_s) * w.rates.compute_fit;
  const double stretch = s.pp > 1 && share < 1 ? shared_core_stretch(s, share) : -1;
  if (stretch >= 0) t.bubble_s = busy * stretch;
  else t.bubble_s = t.bubble < 1 ? busy * t.bubble / (1 - t.bubble) : 0.0;
  t.compute_fit = w.rates.compute_fit;
  t.latency_fit = w.rates.latency_fit;
  t.bandwidth_fit = w.rates.bandwidth_fit;
  return t;
}

}  // namespace composer::suggest_detail

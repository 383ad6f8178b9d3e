#include "runner/train/step.h"

#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <sstream>

#include "parallelisms/comm/trace_span.h"
#include "parallelisms/pipeline/pipeline.h"
#include "parallelisms/tensor_parallel.h"
#include "runner/train/experts.h"
#include "runner/train/optim.h"

namespace composer {
namespace {

// A scalar's value; a dry run's meta tensors have none (0).
double value_of(const torch::Tensor& t) { return t.is_meta() ? 0.0 : t.item<double>(); }

// The global gradient norm as one device sees it, and whether every rank's
// gradients are finite: every rank adds the squares of the gradient pieces it
// is the counting copy of (its placements say which) and counts its pieces
// that are not finite (every piece: a copy that does not count can differ),
// and one all-reduce over the world sums both. `first_bad` is the index in
// `params` of this rank's first gradient that is not finite (-1: none).
// Whether any rank was asked to stop rides on the same all-reduce.
struct GradNorm {
  double norm = 0;
  bool finite = true;
  int64_t first_bad = -1;
  bool stop = false;
};
// Each gradient's sum of squares (0 without a gradient): its 2-norm, as
// PyTorch's clip_grad_norm_ takes each gradient's, squared in double. On the
// CPU in float32 (float64 for a float64 gradient), as grad_norm() takes them
// on one device: squaring in double first cost a float64 copy and two passes
// over it, 146 ms per 25M parameters on one core against 3 ms. On a GPU one
// multi-tensor norm kernel in the gradients' dtype, with one copy to the host
// instead of a synchronisation per parameter.
std::vector<double> grad_squares(const std::vector<torch::Tensor>& params) {
  std::vector<double> out(params.size(), 0.0);
  std::vector<torch::Tensor> on_gpu;
  std::vector<size_t> at_index;
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& g = params[k].grad();
    if (!g.defined()) continue;
    if (g.is_cuda()) {
      on_gpu.push_back(g.detach());
      at_index.push_back(k);
    } else {
      const auto d = g.detach();
      const double n = value_of((d.scalar_type() == torch::kDouble ? d : d.to(torch::kFloat)).norm(2).to(torch::kDouble));
      out[k] = n * n;
    }
  }
  if (on_gpu.empty()) return out;
  std::vector<torch::Tensor> norms = at::_foreach_norm(on_gpu, 2);
  for (auto& n : norms) n = n.to(torch::kDouble);
  const auto host = torch::stack(norms).to(torch::kCPU);
  const auto a = host.accessor<double, 1>();
  for (size_t i = 0; i < at_index.size(); ++i) out[at_index[i]] = a[i] * a[i];
  return out;
}

// On one device the norm is PyTorch's clip_grad_norm_'s (a float32 norm of the norms).
GradNorm global_grad_norm(const std::vector<torch::Tensor>& params, parallel::Parallel& par) {
  GradNorm out;
  if (!par.any) {
    out.stop = stop_requested();
    out.norm = grad_norm(params);
    out.finite = std::isfinite(out.norm);
    for (size_t k = 0; k < params.size() && !out.finite; ++k) {
      const auto& g = params[k].grad();
      if (g.defined() && !std::isfinite(value_of(g.detach().to(torch::kDouble).pow(2).sum()))) {
        out.first_bad = static_cast<int64_t>(k);
        break;
      }
    }
    return out;
  }
  double sq = 0, bad = 0;
  const std::vector<double> squares = grad_squares(params);
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& p = params[k];
    if (!p.grad().defined()) continue;
    const double s = squares[k];
    if (!std::isfinite(s)) {
      bad += 1;
      if (out.first_bad < 0) out.first_bad = static_cast<int64_t>(k);
    }
    const parallel::ShardSpec* spec = par.placements->find(p);
    if (!spec || spec->counts()) sq += s;
  }
  auto t = torch::tensor({sq, bad, stop_requested() ? 1.0 : 0.0}, torch::dtype(torch::kDouble).device(par.device));
  {
    parallel::CommSite site("gradient norm");
    parallel::all_reduce(*par.world, t);
  }
  sq = value_of(t[0]);
  bad = value_of(t[1]);
  out.stop = value_of(t[2]) > 0;
  out.norm = std::sqrt(sq);
  out.finite = bad == 0 && std::isfinite(out.norm);
  return out;
}

// debug.inject: nan_grad: from its step on, rank inject_rank's first gradient
// (after synchronisation, where a real overflow would leave it) gets a NaN.
void inject_nan_grad(const StepState& s, const StepRecord& r) {
  const auto& d = s.c.debug;
  const int rank = s.par.world ? s.par.world->rank : 0;
  if (d.inject != Inject::kNanGrad || r.step < d.inject_step || rank != d.inject_rank) return;
  for (auto& p : s.params) {
    if (!p.grad().defined() || p.grad().numel() == 0 || p.grad().is_meta()) continue;
    torch::NoGradGuard no_grad;
    p.mutable_grad().view({-1})[0] = std::numeric_limits<double>::quiet_NaN();
    return;
  }
}

// The lowest rank holding a non-finite gradient and its first such
// parameter's FQN, the same on every rank ({-1, ""}: only the loss is not finite).
std::pair<int, std::string> nonfinite_culprit(StepState& s, const GradNorm& g) {
  parallel::Parallel& par = s.par;
  const int world = par.world ? par.world->size : 1, rank = par.world ? par.world->rank : 0;
  std::string name;
  if (g.first_bad >= 0) {
    const auto& p = s.params[static_cast<size_t>(g.first_bad)];
    for (const auto& [fqn, q] : models::root_parameters(par.roots)) {
      if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) name = fqn;
    }
  }
  int named = g.first_bad >= 0 ? rank : -1;
  if (par.world) {
    auto who = torch::tensor({g.first_bad >= 0 ? static_cast<double>(world - rank) : 0.0},
                             torch::dtype(torch::kDouble).device(par.device));
    parallel::all_reduce(*par.world, who, parallel::Reduce::kMax);
    const int top = static_cast<int>(value_of(who));
    named = top > 0 ? world - top : -1;
    if (named >= 0) {  // its parameter's name, to every rank
      auto text = torch::zeros({256}, torch::dtype(torch::kByte));
      for (size_t i = 0; i < name.size() && i < 255; ++i) text[static_cast<int64_t>(i)] = static_cast<uint8_t>(name[i]);
      auto wire = text.to(par.device);
      parallel::broadcast(*par.world, wire, named);
      text = wire.cpu();
      name = reinterpret_cast<const char*>(text.data_ptr<uint8_t>());
    }
  }
  return {named, name};
}

// A step whose loss or gradient is not finite (the same decision on every
// rank: the loss is gathered and the count of non-finite gradients summed
// with the norm). Names the lowest rank holding a non-finite gradient and its
// first such parameter (two more small collectives, only now), then stops the
// job or, with train.on_nonfinite: skip, leaves the update out (up to
// max_skipped steps in a row).
void on_nonfinite(StepState& s, StepRecord& r, const GradNorm& g) {
  parallel::Parallel& par = s.par;
  const int world = par.world ? par.world->size : 1, rank = par.world ? par.world->rank : 0;
  const auto [named, name] = nonfinite_culprit(s, g);
  std::ostringstream what;
  if (named >= 0) {
    what << "the gradient of " << name << " on rank " << named << " is not finite";
  } else {
    what << "the loss is not finite";
  }
  auto shown = [](double v) {  // NaN's sign bit means nothing to a reader: "nan", never "-nan"
    std::ostringstream os;
    if (std::isnan(v)) {
      os << "nan";
    } else {
      os << v;
    }
    return os.str();
  };
  what << " (loss " << shown(r.loss) << ", gradient norm " << shown(g.norm) << ")";
  const auto& t = s.c.train;
  if (t.on_nonfinite == OnNonFinite::kSkip && s.skipped_in_a_row < t.max_skipped) {
    ++s.skipped_in_a_row;
    r.skipped = true;
    for (auto& p : s.params) p.mutable_grad() = torch::Tensor();
    if (rank == 0) {
      std::cout << "[rank 0/" << world << "] step " << r.step << ": " << what.str()
                << "; train.on_nonfinite: skip left this step's update "
                << "out (" << s.skipped_in_a_row << " in a row, at most " << t.max_skipped << ")" << std::endl;
    }
    return;
  }
  if (t.on_nonfinite == OnNonFinite::kSkip) {
    what << "; that is " << s.skipped_in_a_row + 1 << " steps in a row (train.max_skipped " << t.max_skipped
         << "): stopped before the update";
  } else {
    what << "; train.on_nonfinite: stop stopped the job before the update";
  }
  throw Diverged(r.step, what.str() +
                             ". Nothing was saved after the last checkpoint. Look for the cause (the "
                             "learning rate, the data, a mixed-precision overflow), or set "
                             "train.on_nonfinite: skip to leave such steps out");
}

// This rank's part of a batch: under context parallelism, its slice of every
// sequence in the token ids and in targets given per token. A loss divided by
// the global batch's token count (loss_tokens) is then divided by 1/cp of it:
// averaged over the cp ranks (their gradients and the logged loss), the
// slices' sums add up.
Batch local_part(const parallel::Parallel& par, Batch b) {
  if (!par.cp) return b;
  const bool per_token = b.targets.defined() && b.targets.dim() >= 2 && b.targets.size(1) == b.inputs.size(1);
  b.inputs = par.sequence_slice(b.inputs);
  if (per_token) b.targets = par.sequence_slice(b.targets);
  b.loss_tokens /= par.cp->group().size;
  return b;
}

// Packed documents: the model's attention and positions read `doc_start`
// (undefined: none) until the next call.
void set_documents(models::Model& model, const torch::Tensor& doc_start) {
  if (auto* slot = model.sequence_slot()) slot->set_doc_start(doc_start);
}

int64_t nbytes(const torch::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// Pipeline microbatch mb's inputs and its loss (its share of the global-batch
// loss) over this rank's batch `b`; `after_loss` runs after each loss.
struct Microbatches {
  const Batch& b;
  int64_t k;  // samples per microbatch
  const LossConfig& loss;
  int64_t global_batch;
  const parallel::VocabParallel& vocab;
  std::function<void()> after_loss;
  torch::Tensor input(int mb) const { return b.inputs.narrow(0, mb * k, k); }
  // What the pipeline runs before each action of microbatch mb: `model` reads
  // its documents (nothing without packed documents).
  // `on_microbatch` (composer diff's recorder) hears of each too.
  std::function<void(int)> enter(models::Model& model, const std::function<void(int64_t)>& on_microbatch) const {
    if (!b.doc_start.defined() && !on_microbatch) return {};
    return [this, &model, on_microbatch](int mb) {
      if (b.doc_start.defined()) set_documents(model, b.doc_start.narrow(0, mb * k, k));
      if (on_microbatch) on_microbatch(mb);
    };
  }
  torch::Tensor loss_of(int mb, const torch::Tensor& out) const {
    const bool per_sample = b.targets.defined() && b.targets.dim() > 0 && b.targets.size(0) == b.inputs.size(0);
    auto l = compute_loss(loss, out, per_sample ? b.targets.narrow(0, mb * k, k) : b.targets, k, global_batch, vocab,
                          b.loss_tokens);
    if (after_loss) after_loss();
    return l;
  }
};

// One pipeline step over this rank's batch. Backward runs on each microbatch
// loss x grad_scale x the pipeline's own factor (its scale_grads, resolved by
// the planner). Returns the sum of the microbatch shares: the batch loss.
double pipeline_step(parallel::Pipeline& pipe, models::Model& model, const ExperimentConfig& c, const Plan& plan,
                     const Batch& b, double grad_scale, const parallel::Delays& delays,
                     const parallel::VocabParallel& vocab, const std::function<void(int64_t)>& on_microbatch) {
  const auto& t = c.train;
  const Microbatches m{b, plan.local_microbatch, t.loss, t.global_batch, vocab,
                       [&delays] { delays.at(parallel::DelayPoint::kAfterLoss); }};
  const double loss = pipe.run([&](int mb) { return m.input(mb); },
                               [&](int mb, const torch::Tensor& out) { return m.loss_of(mb, out); }, grad_scale,
                               m.enter(model, on_microbatch));
  set_documents(model, {});
  return loss;
}

// The idle fraction of the last step over the pipeline ranks: 1 - busy time
// / (ranks x the longest rank's span).
double pipeline_bubble(parallel::Pipeline& pipe, c10::Device device) {
  double busy = 0, span = 0;
  for (const auto& e : pipe.timeline()) {
    busy += e.end_ms - e.start_ms;
    span = std::max(span, e.end_ms);
  }
  auto t = torch::tensor({busy, span}, torch::dtype(torch::kDouble).device(device));
  auto all = parallel::all_gather(pipe.group(), t.view({1, 2}), std::vector<int64_t>(pipe.group().size, 1));
  const double total_busy = value_of(all.select(1, 0).sum());
  const double makespan = value_of(all.select(1, 1).max());
  return makespan > 0 ? 1.0 - total_busy / (pipe.group().size * makespan) : 0.0;
}

}  // namespace

void reset_counters(RankContext& rank) {
  if (!rank.mesh) return;
  for (auto* g : rank.mesh->all_groups()) g->counter->reset();
}

void add_comm(RankContext& rank, StepRecord& r) {
  if (!rank.mesh) return;
  r.parallel = true;
  for (auto* g : rank.mesh->all_groups()) {
    for (const auto& [op, e] : g->counter->all()) {
      if (op == "recv") continue;  // the sender's payload, counted at its send
      r.comm_calls += e.calls;
      r.comm_bytes += e.bytes;
      if (e.bytes > 0) r.comm_bytes_by_group[g->name] += e.bytes;
      r.comm_ring_bytes += e.ring_bytes;
    }
  }
}

CommBytes comm_bytes(RankContext& rank) {
  CommBytes out;
  if (!rank.mesh) return out;
  for (auto* g : rank.mesh->all_groups()) {
    for (const auto& [op, e] : g->counter->all()) out[g->name][op] += e.bytes;
  }
  return out;
}

MemoryTerms memory_terms(const parallel::Parallel& par, const std::vector<torch::Tensor>& params, int64_t buffers_before,
                         int64_t before, int64_t after) {
  MemoryTerms m;
  for (const auto& p : params) {
    m.params += nbytes(p);
    m.grads += nbytes(p.grad());
  }
  m.buffers = par.buffer_bytes();
  m.optimizer = after - before - m.grads - (m.buffers - buffers_before);
  return m;
}

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// The pipeline schedule over this rank's batch; returns its loss share.
// The schedule interleaves microbatches: every reduction waits for the step's
// end (finish_grad_sync), one per unit or bucket.
double pipelined(StepState& s, StepRecord& r) {
  parallel::Parallel& par = s.par;
  const auto phase = Clock::now();
  Batch b = local_part(par, s.batch(r.step, s.batch_begin, s.batch_begin + s.plan.local_batch));
  par.set_requires_sync(false);
  const double loss = pipeline_step(*par.pipe, s.model, s.c, s.plan, b, s.grad_scale, s.delays, par.vocab,
                                    s.on_microbatch);
  par.reshard();
  r.backward_ms = ms_since(phase);  // forward and backward interleave
  r.pipeline_bubble = pipeline_bubble(*par.pipe, par.device);
  r.pipeline_bubble_formula = parallel::bubble_formula(par.pipe->kind(), par.pipe->shape());
  return loss;
}

// Every microbatch's forward and backward (gradient accumulation); the last
// one's backward starts the reductions. Returns the loss share.
double accumulated(StepState& s, StepRecord& r) {
  const auto& t = s.c.train;
  parallel::Parallel& par = s.par;
  const int64_t mb = s.plan.local_microbatch;
  double loss_sum = 0;
  for (int64_t m = 0; m < t.microbatches; ++m) {
    par.set_requires_sync(m + 1 == t.microbatches);
    const int64_t begin = s.batch_begin + m * mb;
    Batch b = local_part(par, s.batch(r.step, begin, begin + mb));
    set_documents(s.model, b.doc_start);  // until this microbatch's backward (recomputation) is done
    if (s.on_microbatch) s.on_microbatch(m);
    auto phase = Clock::now();
    auto loss = compute_loss(t.loss, s.model(b.inputs), b.targets, mb, t.global_batch, par.vocab, b.loss_tokens);
    r.forward_ms += ms_since(phase);
    s.delays.at(parallel::DelayPoint::kAfterLoss);
    phase = Clock::now();
    (s.grad_scale == 1.0 ? loss : loss * s.grad_scale).backward();
    loss_sum += value_of(loss);
    par.reshard();
    r.backward_ms += ms_since(phase);
  }
  set_documents(s.model, {});
  return loss_sum;
}

// The global-batch loss from every rank's share into r.loss (and, under a
// pipeline, each microbatch's loss, which the last stage's ranks have). A
// context-parallel rank's share is the mean over its tokens: averaged over cp.
void gather_loss(parallel::Parallel& par, double local_loss, StepRecord& r) {
  r.loss = local_loss;
  if (!par.pipe && !par.dp && !par.cp) return;
  std::vector<double> v{local_loss};
  if (par.pipe) {
    for (double x : par.pipe->microbatch_losses()) v.push_back(x);
  }
  auto l = torch::tensor(v, torch::dtype(torch::kDouble).device(par.device));
  parallel::CommSite site("loss");
  if (par.pipe) parallel::all_reduce(par.pipe->group(), l);
  if (par.dp) parallel::all_reduce(*par.dp, l);
  if (par.cp) parallel::all_reduce(par.cp->group(), l, parallel::Reduce::kAvg);
  r.loss = value_of(l[0]);
  for (int64_t i = 1; i < l.size(0); ++i) r.microbatch_losses.push_back(value_of(l[i]));
}

}  // namespace

void run_step(StepState& s, StepRecord& r) {
  parallel::Parallel& par = s.par;
  for (auto& p : s.params) p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none=True)
  const double local_loss = par.pipe ? pipelined(s, r) : accumulated(s, r);
  if (s.data_wait_ms) r.data_wait_ms = s.data_wait_ms();
  auto phase = Clock::now();
  par.finish_grad_sync();
  r.backward_ms += ms_since(phase);
  gather_loss(par, local_loss, r);
  s.delays.at(parallel::DelayPoint::kBeforeOptimizerStep);
  phase = Clock::now();
  inject_nan_grad(s, r);
  if (s.after_grad_sync) s.after_grad_sync();  // the gradients the optimizer reads
  const GradNorm g = global_grad_norm(s.params, par);
  r.grad_norm = g.norm;
  r.stop = g.stop;
  if (!g.finite || !std::isfinite(r.loss)) {
    finish_experts(s.model, par, /*update=*/false);
    on_nonfinite(s, r, g);
    r.optimizer_ms = ms_since(phase);
    return;
  }
  s.skipped_in_a_row = 0;
  if (s.c.train.grad_clip > 0) clip_grads(s.params, r.grad_norm, s.c.train.grad_clip);
  {
    parallel::TraceSpan span([] { return std::string("optimizer step"); });
    s.optimizer.step();
  }
  const ExpertStats experts = finish_experts(s.model, par, /*update=*/true);
  if (experts.any) {
    r.expert_tokens = experts.tokens;
    r.expert_imbalance = experts.imbalance;
    r.expert_dropped = experts.dropped;
  }
  r.optimizer_ms = ms_since(phase);
}

double evaluate(StepState& s, const std::function<Batch(int64_t, int64_t, int64_t)>& batch, int64_t batches) {
  parallel::Parallel& par = s.par;
  const auto& t = s.c.train;
  torch::NoGradGuard no_grad;
  const bool training = s.model.is_training();
  s.model.eval();
  if (par.fsdp) par.fsdp->set_forward_only(true);
  // Eval's geometry (eval.global_batch and seq_len, checked by the planner; a pipeline's is training's).
  const int64_t local_batch = s.plan.eval_local_batch, mb = s.plan.eval_local_microbatch;
  const int64_t global_batch = s.c.eval.global_batch ? s.c.eval.global_batch : t.global_batch;
  const int64_t begin = (par.dp ? par.dp->rank : 0) * local_batch;
  double sum = 0;
  for (int64_t j = 1; j <= batches; ++j) {
    double share = 0;
    if (par.pipe) {
      const Batch b = local_part(par, batch(j, begin, begin + local_batch));
      const Microbatches m{b, mb, t.loss, global_batch, par.vocab, {}};
      share = par.pipe->evaluate([&](int i) { return m.input(i); },
                                 [&](int i, const torch::Tensor& out) { return m.loss_of(i, out); },
                                 m.enter(s.model, {}));
    } else {
      for (int64_t m = 0; m < t.microbatches; ++m) {
        const Batch b = local_part(par, batch(j, begin + m * mb, begin + (m + 1) * mb));
        set_documents(s.model, b.doc_start);
        share += value_of(
            compute_loss(t.loss, s.model(b.inputs), b.targets, mb, global_batch, par.vocab, b.loss_tokens));
      }
    }
    par.reshard();
    set_documents(s.model, {});
    StepRecord r;
    gather_loss(par, share, r);  // the batch loss, as training's
    sum += r.loss;
  }
  if (par.fsdp) par.fsdp->set_forward_only(false);
  s.model.train(training);
  return sum / static_cast<double>(batches);
}

namespace {

// Each target's -log softmax(logits)[target], over the whole vocabulary under loss parallelism.
torch::Tensor token_nll(const torch::Tensor& output, const torch::Tensor& targets, const parallel::VocabParallel& vocab) {
  const torch::Tensor y = output.to(torch::kFloat).reshape({-1, output.size(-1)});
  const torch::Tensor t = targets.reshape({-1});
  if (vocab.group) return parallel::vocab_parallel_token_nll(vocab, y, t);
  return -torch::log_softmax(y, 1).gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1);
}

}  // namespace

torch::Tensor score_tokens(models::Model& model, parallel::Parallel& par, int64_t microbatch, const Batch& whole,
                           const torch::Tensor& positions) {
  torch::NoGradGuard no_grad;
  const Batch b = local_part(par, whole);
  const torch::Tensor pos = par.cp ? par.sequence_slice(positions) : positions;
  const torch::Tensor rows = torch::arange(b.inputs.size(0), pos.options()).unsqueeze(1).expand_as(pos);
  std::vector<torch::Tensor> out;
  auto collect = [&](int64_t i, const torch::Tensor& logits) {
    const int64_t k = microbatch;
    const torch::Tensor t = b.targets.narrow(0, i * k, k).reshape({-1});
    const torch::Tensor nll = token_nll(logits, t, par.vocab);
    const torch::Tensor kept = t != -100;
    out.push_back(torch::stack({rows.narrow(0, i * k, k).reshape({-1}).to(torch::kDouble),
                                pos.narrow(0, i * k, k).reshape({-1}).to(torch::kDouble), nll.to(torch::kDouble)},
                               1)
                      .index({kept})
                      .cpu());
  };
  if (par.pipe) {
    par.pipe->evaluate([&](int i) { return b.inputs.narrow(0, i * microbatch, microbatch); },
                       [&](int i, const torch::Tensor& logits) {
                         collect(i, logits);
                         return torch::zeros({}, logits.options().dtype(torch::kFloat));
                       });
  } else {
    for (int64_t i = 0; i < b.inputs.size(0) / microbatch; ++i) {
      collect(i, model(b.inputs.narrow(0, i * microbatch, microbatch)));
    }
  }
  par.reshard();
  return out.empty() ? torch::empty({0, 3}, torch::kDouble) : torch::cat(out);
}

}  // namespace composer

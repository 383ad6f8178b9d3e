#include "runner/train/trainer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "parallelisms/context_parallel.h"
#include "runner/base/memory.h"
#include "runner/checkpoint/checkpoint.h"
#include "runner/checkpoint/export.h"
#include "runner/observe/step_watch.h"
#include "runner/train/build.h"
#include "runner/train/experts.h"
#include "runner/train/optim.h"
#include "runner/train/record.h"
#include "runner/train/step.h"

namespace composer {
namespace {

// A batch on the rank's device (the data is read on the CPU).
Batch on_device(Batch b, c10::Device device) {
  if (device.is_cpu()) return b;
  b.inputs = b.inputs.to(device);
  if (b.targets.defined()) b.targets = b.targets.to(device);
  if (b.doc_start.defined()) b.doc_start = b.doc_start.to(device);
  return b;
}

// debug.inject: the wrong step a plausible bug would compute, for proving that
// the golden checks fail on it. grad_factor multiplies the gradients (a wrong
// dp divisor, scale_grads applied twice); data_shift moves the last dp rank's
// batch by one microbatch (a microbatch index off by one: one microbatch of the
// global batch dropped, one from outside it read).
struct Injection {
  double grad_factor = 1.0;
  int64_t data_shift = 0;
};

Injection injection(const ExperimentConfig& c, const Plan& plan, int64_t dp_rank, const RankContext& rank) {
  Injection in;
  if (c.debug.inject == Inject::kNone) return in;
  if (c.debug.inject == Inject::kGradX2) in.grad_factor = 2.0;
  if (c.debug.inject == Inject::kMicrobatchOffByOne && dp_rank + 1 == plan.dp_size) {
    in.data_shift = plan.local_microbatch;
  }
  if (rank.is_main()) {
    std::cout << rank.log_prefix << "debug.inject: " << name_of(c.debug.inject)
              << ": this run trains wrongly on purpose\n";
  }
  return in;
}

// "250 ms before_reduce_scatter, ..." for the entries on `rank`.
std::string delay_summary(const std::vector<parallel::Delay>& delays, int rank) {
  std::string out;
  for (const auto& d : delays) {
    if (!d.ranks.empty() && std::find(d.ranks.begin(), d.ranks.end(), rank) == d.ranks.end()) continue;
    out += (out.empty() ? "" : ", ") + std::to_string(d.ms) + " ms " + parallel::name_of(d.point);
  }
  return out;
}

// Where this rank's activations lie in the step (record.h): its samples as
// the plan means them (debug.inject's shift left out) and the factor its
// backward runs with.
RecordLayout record_layout(const ExperimentConfig& c, const Plan& plan, const RankModel& rm) {
  RecordLayout out;
  out.batch_begin = (rm.par.dp ? rm.par.dp->rank : 0) * plan.local_batch;
  out.microbatch = plan.local_microbatch;
  out.local_batch = plan.local_batch;
  out.global_batch = c.train.global_batch;
  out.seq_len = rm.data.inputs == InputKind::kTokens ? rm.data.seq_len : 0;
  const auto* pipeline = plan.find<PipelineConfig>();
  out.grad_divisor = static_cast<double>(plan.dp_size) * (pipeline ? pipeline->loss_factor : 1.0) *
                     (rm.par.cp ? rm.par.cp->group().size : 1);
  return out;
}

// What the rank's transforms applied to: its stage roots, or the whole model.
std::vector<models::Root> rank_roots(const RankModel& rm) {
  return rm.par.roots.empty() ? std::vector<models::Root>{models::whole(*rm.model)} : rm.par.roots;
}

// What the loop measured, for the reports after it.
struct LoopResult {
  std::vector<StepRecord> steps;
  std::vector<int64_t> step_peaks;  // counted tensor bytes per step
  MemoryTerms terms;                // after the first step
  CommBytes comm;                   // of the last step
};

// What the loop runs on: the rank, its model with the plan applied, its
// parameters and optimizer, and where checkpoints go.
struct Loop {
  const ExperimentConfig& c;
  const Plan& plan;
  RankContext& rank;
  RankModel& rm;
  std::vector<torch::Tensor>& params;
  Optimizer& optimizer;
  Checkpointer& checkpointer;
  const std::vector<HeldParam>& saved;  // what checkpoints hold: every parameter but the frozen ones, and buffers
  std::string out_dir;
  bool checkpoints = false;
  StepRecorder* recorder = nullptr;  // composer diff: records one step, the last one run
  int64_t first_step = 1;
  int64_t last_step = 0;
  std::shared_ptr<int64_t> step = std::make_shared<int64_t>(0);  // the step running (debug.inject's module faults)
  int64_t setup_live_bytes = 0;  // counted tensor bytes before the first step
};

// What the watch looks at: this rank, its device and its counters.
WatchedRun watched_run(const Loop& l) {
  RankContext& rank = l.rank;
  parallel::Parallel& par = l.rm.par;
  const c10::Device device = rank.device;
  WatchedRun w{l.c};
  w.out_dir = l.out_dir;
  w.rank = rank.rank;
  w.world_size = rank.world_size;
  w.log_prefix = rank.log_prefix;
  w.first_step = l.first_step;
  w.seq_len = l.rm.data.inputs == InputKind::kTokens ? l.rm.data.seq_len : 0;
  w.device = device;
  w.cuda = rank.cuda;
  w.ac = par.ac.get();
  w.barrier = [p = &par, device] {
    if (!p->world) return;
    auto t = torch::zeros({1}, torch::TensorOptions().device(device));
    parallel::all_reduce(*p->world, t);
  };
  w.reset_comm = [ctx = &rank] { reset_counters(*ctx); };
  if (par.world) {  // every rank's figures of a step, to every rank (stragglers)
    w.gather_ranks = [p = &par, r = rank.rank](const std::vector<double>& mine) {
      const int64_t n = static_cast<int64_t>(mine.size());
      auto t = torch::zeros({p->world->size, n}, torch::kDouble);
      for (int64_t i = 0; i < n; ++i) t[r][i] = mine[i];
      parallel::CommSite site("step figures");
      parallel::all_reduce(*p->world, t);
      return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
    };
  }
  w.add_comm = [ctx = &rank](StepRecord& r) { add_comm(*ctx, r); };
  return w;
}

// What a step reads on this rank: its share of each global batch (moved by
// debug.inject) and the scale its backward runs with.
StepState step_state(const Loop& l, const parallel::Delays& delays) {
  RankContext& rank = l.rank;
  parallel::Parallel& par = l.rm.par;
  const int64_t dp_rank = par.dp ? par.dp->rank : 0;
  const Injection inject = injection(l.c, l.plan, dp_rank, rank);
  // Each rank's loss is its share of the global-batch loss; averaging gradients
  // over the dp ranks divides by dp_size, so backward runs on dp_size x share.
  const double grad_scale = static_cast<double>(l.plan.dp_size) * inject.grad_factor;
  // A mixture-of-experts block's load-balancing loss, per sequence, weighs as
  // one sample of the loss does in backward.
  const auto* pipeline = l.plan.find<PipelineConfig>();
  bind_experts(*l.rm.model, l.c.train.loss.scale * grad_scale * (pipeline ? pipeline->loss_factor : 1.0) /
                                static_cast<double>(l.c.train.global_batch));
  const c10::Device device = rank.device;
  DataSet* dataset = l.rm.dataset.get();
  const bool drop_documents = l.c.debug.inject == Inject::kNoDocumentMask;
  // This rank's share of every global batch, read a step ahead.
  const int64_t begin = dp_rank * l.plan.local_batch + inject.data_shift;
  auto ahead = std::make_shared<Prefetcher>(*dataset, begin, begin + l.plan.local_batch, l.c.train.steps);
  auto batch = [ahead, device, drop_documents](int64_t step, int64_t first, int64_t end) {
    Batch b = ahead->batch(step, first, end);
    if (drop_documents) b.doc_start = torch::Tensor();
    return on_device(std::move(b), device);
  };
  // The fields in StepState's order, not as a table.
  // clang-format off
  StepState s{l.c, l.plan, *l.rm.model, par, l.params, l.optimizer, batch, begin,
              [ahead] { return ahead->take_wait_ms(); }, grad_scale, delays};
  // clang-format on
  if (StepRecorder* rec = l.recorder) {
    s.on_microbatch = [rec](int64_t mb) { rec->set_microbatch(mb); };
    s.after_grad_sync = [rec] { rec->after_grad_sync(); };
  }
  return s;
}

// debug.inject: module_output and module_grad: on rank inject_rank, in step
// inject_step, module inject_module's output (or the gradient flowing back into
// its input) is 1.01 times what it computed, in every microbatch.
void install_module_fault(const Loop& l) {
  const DebugConfig& d = l.c.debug;
  if ((d.inject != Inject::kModuleOutput && d.inject != Inject::kModuleGrad) || l.rank.rank != d.inject_rank) return;
  nn::Module* target = nullptr;
  for (const auto& root : rank_roots(l.rm)) {
    for (const auto& [name, m] : root.modules) {
      if (name == d.inject_module) target = m;
    }
  }
  if (!target) {
    throw UserError(d.inject_module_ref.where() + ": debug.inject_module: rank " + std::to_string(d.inject_rank) +
                    " holds no module " + d.inject_module + " (a pipeline stage of another rank holds it); set "
                    "inject_rank to a rank of that stage");
  }
  const auto step = l.step;
  const int64_t at = d.inject_step;
  if (d.inject == Inject::kModuleOutput) {
    target->add_post_hook([step, at](nn::Module&, const torch::Tensor&, torch::Tensor y) {
      return *step == at && y.is_floating_point() ? y * 1.01 : y;
    });
  } else {
    target->add_pre_hook_first([step, at](nn::Module&, torch::Tensor x) {
      if (*step != at || !x.is_floating_point() || !x.requires_grad() || !torch::GradMode::is_enabled()) return x;
      auto v = x.view_as(x);
      v.register_hook([](torch::Tensor g) { return g * 1.01; });
      return v;
    });
  }
}

// debug.fail_at: step: this rank fails on purpose as debug.fail_step begins.
void fail_if_asked(const Loop& l, int64_t step) {
  const DebugConfig& d = l.c.debug;
  if (l.rank.rank == d.fail_rank && step == d.fail_step && d.fail_at == FailAt::kStep &&
      l.rank.attempt < d.fail_attempts) {
    fail_on_purpose(d, l.rank.rank, "at step " + std::to_string(step));
  }
}

// eval.every: the mean held-out loss after every eval.every-th step and the last.
void evaluate_if_due(const Loop& l, StepState& state, StepRecord& r) {
  if (!l.rm.eval_dataset || (r.step % l.c.eval.every != 0 && r.step != l.c.train.steps)) return;
  const c10::Device device = l.rank.device;
  DataSet* eval_dataset = l.rm.eval_dataset.get();
  r.has_eval = true;
  r.eval_loss = evaluate(
      state,
      [eval_dataset, device](int64_t step, int64_t begin, int64_t end) {
        return on_device(eval_dataset->batch(step, begin, end), device);
      },
      l.c.eval.batches);
}

// A stop request honoured after `step`: what was saved and how to go on.
Stopped stopped(const Loop& l, int64_t step) {
  return Stopped("asked to stop (SIGTERM or SIGINT); step " + std::to_string(step) + " of " +
                 std::to_string(l.c.train.steps) + " finished on every rank" +
                 (l.checkpoints ? " and its checkpoint is saved in " + l.checkpointer.dir() +
                                      "; run the same command again to resume"
                                : "; nothing was saved (composer check and golden keep no checkpoints)"));
}

// The steps from l.first_step to train.steps, each watched (metrics, progress
// line, TensorBoard, profiler), evaluated and checkpointed when due.
LoopResult run_loop(const Loop& l, const parallel::Delays& delays) {
  const auto& t = l.c.train;
  StepWatch watch(watched_run(l));
  StepState state = step_state(l, delays);
  const int64_t buffers_before = l.rm.par.buffer_bytes();
  LoopResult out;
  const int64_t last = l.last_step ? l.last_step : t.steps;
  for (int64_t step = l.first_step; step <= last; ++step) {
    *l.step = step;
    if (l.rank.flight) l.rank.flight->set_step(step);
    watch.begin(step);
    fail_if_asked(l, step);
    StepRecord r;
    r.step = step;
    r.lr = lr_at(t.optimizer, t.lr_schedule, step, t.steps);
    l.optimizer.set_lr(r.lr, l.c.train.optimizer.lr);
    const bool recording = l.recorder && l.recorder->records(step);
    if (recording) l.recorder->begin();
    run_step(state, r);
    if (recording) l.recorder->end();
    if (l.recorder && l.recorder->records_params_every_step()) l.recorder->params_after(step);
    if (step == l.first_step) {
      out.terms = memory_terms(l.rm.par, l.params, buffers_before, l.setup_live_bytes, memory::live_bytes());
    }
    out.comm = comm_bytes(l.rank);  // before the watch's end: the profiler's barrier is not the step's
    watch.end(step, r);
    out.step_peaks.push_back(memory::peak_bytes());
    evaluate_if_due(l, state, r);  // after the step's figures
    watch.show(r);
    out.steps.push_back(r);
    const bool stops = r.stop && step < t.steps;  // every rank saw it in this step's gradient-norm reduction
    if (l.checkpoints && (l.checkpointer.due(step) || stops)) l.checkpointer.save(step, l.saved, l.optimizer);
    if (stops) {
      l.checkpointer.finish();
      throw stopped(l, step);
    }
  }
  l.checkpointer.finish();  // the last save is on disk before the run ends
  return out;
}

// What every rank writes after training: its counted memory, the bytes its
// collectives moved in the last step, a pipeline rank's timeline, and its
// part of final.safetensors.
void write_reports(const Loop& l, const LoopResult& res, int64_t setup_peak_bytes, double setup_peak_rss_mb) {
  const std::string& out_dir = l.out_dir;
  RankContext& rank = l.rank;
  parallel::Parallel& par = l.rm.par;
  const std::string r = std::to_string(rank.rank);
  if (memory::counting() && !res.step_peaks.empty()) {
    const MemoryTerms& m = res.terms;
    write_json(out_dir + "/memory.rank" + r + ".json",
               {{"rank", rank.rank},
                {"setup_live_bytes", l.setup_live_bytes},
                {"setup_peak_bytes", setup_peak_bytes},
                {"setup_peak_rss_mb", setup_peak_rss_mb},
                {"peak_bytes", *std::max_element(res.step_peaks.begin(), res.step_peaks.end())},
                {"step_peak_bytes", res.step_peaks},
                {"terms", {{"params", m.params}, {"grads", m.grads}, {"optimizer", m.optimizer},
                           {"buffers", m.buffers}}}});
  }
  if (rank.mesh && !res.step_peaks.empty()) {
    write_json(out_dir + "/comm.rank" + r + ".json", {{"rank", rank.rank}, {"bytes", res.comm}});
  }
  if (par.pipe) {  // a Chrome trace of the last step's actions (rank as process, times in us)
    nlohmann::json tl = nlohmann::json::array();
    tl.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank.rank}, {"args", {{"name", "rank " + r}}}});
    for (const auto& e : par.pipe->timeline()) {
      tl.push_back({{"ph", "X"}, {"name", e.action}, {"cat", e.action.substr(0, 1)}, {"pid", rank.rank}, {"tid", 0},
                    {"ts", e.start_ms * 1e3}, {"dur", (e.end_ms - e.start_ms) * 1e3}});
    }
    write_json(out_dir + "/timeline.rank" + r + ".json", {{"traceEvents", tl},
                                                          {"displayTimeUnit", "ms"},
                                                          {"rank", rank.rank},
                                                          {"stages", par.pipe->local_stages()}});
  }
  if (par.any) {
    write_final_weights(*l.rm.model, par.placements.get(), par.world, rank.rank, out_dir + "/final.safetensors");
  } else if (rank.is_main()) {
    write_final_weights(*l.rm.model, nullptr, nullptr, 0, out_dir + "/final.safetensors");
  }
}

// What checkpoints hold of `held`: all of it, or under train.freeze and train.lora what trains and the
// buffers; the frozen parameters are the start's again on every resume (frozen_base, checked before launch).
std::vector<HeldParam> checkpointed(const ExperimentConfig& c, const std::vector<HeldParam>& held) {
  std::vector<HeldParam> saved;
  for (const HeldParam& h : held) {
    if (h.buffer || h.param.requires_grad() || !saves_trained_only(c)) saved.push_back(h);
  }
  return saved;
}

// checkpoint.resume: the checkpoint's parameters and optimizer state loaded, training from the step after it.
void resume_if_asked(Loop& l) {
  const std::string from = l.checkpointer.resume_path();
  if (from.empty()) return;
  l.first_step = l.checkpointer.load(from, l.saved, l.optimizer) + 1;
  if (!l.rank.is_main()) return;
  std::cout << l.rank.log_prefix << "resuming from " << from << " (step " << l.first_step - 1 << " of "
            << l.c.train.steps
            << (l.first_step > l.c.train.steps ? "; training is complete, checkpoint.resume: never trains again" : "")
            << ")\n";
}

}  // namespace

TrainResult train(const ExperimentConfig& c, const Plan& plan, RankContext& rank, const std::string& out_dir,
                  bool checkpoints, const RecordOptions& record, GoldenStart* start) {
  torch::set_num_threads(rank_threads(c.train, rank.local_world_size));
  parallel::mark_training_thread();
  RankModel rm = build_rank_model(c, plan, rank, out_dir, start);
  const int64_t setup_peak_bytes = memory::peak_bytes();  // building the model and the transforms
  const double setup_peak_rss_mb = peak_rss_mb();

  std::vector<torch::Tensor> params = rm.par.held_params();
  params.erase(std::remove_if(params.begin(), params.end(), [](const torch::Tensor& p) { return !p.requires_grad(); }),
               params.end());  // train.freeze: a frozen parameter gets no optimizer state
  auto optimizer = make_optimizer(c.train.optimizer, params, names_in(*rm.model, params),
                                  std::make_shared<parallel::WholeMatrices>(
                                      c.debug.inject == Inject::kMuonLocalPiece ? nullptr : rm.par.placements.get()));
  std::vector<HeldParam> held;
  for (auto& [name, p] : nn::unique_named_parameters(*rm.model)) held.push_back({name, p, rm.par.placements->find(p)});
  for (const auto& b : rm.model->named_buffers()) {
    held.push_back({b.key(), b.value(), rm.par.placements->find(b.value()), /*buffer=*/true});
  }
  const std::vector<HeldParam> saved = checkpointed(c, held);
  Checkpointer checkpointer(c, out_dir, rank.rank, rm.par.world, rank.log_prefix,
                            rank.mesh ? rank.mesh->store() : c10::intrusive_ptr<c10d::Store>(), rank.attempt);
  Loop loop{c, plan, rank, rm, params, *optimizer, checkpointer, saved, out_dir, checkpoints};
  std::unique_ptr<StepRecorder> recorder;
  if (record.step != 0) {
    recorder = std::make_unique<StepRecorder>(record, rank_roots(rm), rm.par, held, rank.rank,
                                              record_layout(c, plan, rm));
    loop.recorder = recorder.get();
    if (record.step > 0) loop.last_step = std::min(record.step, c.train.steps);
  }
  install_module_fault(loop);
  if (checkpoints) resume_if_asked(loop);
  // Peak RSS in the metrics covers training; setup (building the model,
  // applying the transforms, writing init weights) is memory.rank<r>.json's
  // setup_peak_bytes and setup_peak_rss_mb.
  reset_peak_rss();
  loop.setup_live_bytes = memory::live_bytes();
  static const parallel::Delays kNoDelays({}, 0);
  const parallel::Delays& delays = rank.delays ? *rank.delays : kNoDelays;
  if (!delays.empty()) {
    std::cout << rank.log_prefix << "debug.delay: this rank sleeps at " << delay_summary(c.debug.delay, rank.rank)
              << "; the results must not change\n";
  }
  const LoopResult res = run_loop(loop, delays);
  if (!delays.empty()) {
    std::cout << rank.log_prefix << "debug.delay: slept " << delays.slept() << " times, " << delays.slept_ms()
              << " ms in all\n";
  }
  write_reports(loop, res, setup_peak_bytes, setup_peak_rss_mb);
  return {res.steps};
}

}  // namespace composer

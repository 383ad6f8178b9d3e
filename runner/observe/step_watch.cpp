#include "runner/observe/step_watch.h"

#include <algorithm>
#include <iostream>
#include <utility>
#include <vector>

#include "runner/base/memory.h"

namespace composer {
namespace {

// A rank's own figures of a step, for its TensorBoard run.
std::vector<std::pair<std::string, double>> rank_scalars(const StepRecord& r) {
  std::vector<std::pair<std::string, double>> out{{"step_ms", r.step_ms}, {"peak_rss_mb", r.peak_rss_mb}};
  if (r.peak_alloc_mb >= 0) out.emplace_back("peak_alloc_mb", r.peak_alloc_mb);
  if (r.device_peak_allocated_mb >= 0) out.emplace_back("device_peak_allocated_mb", r.device_peak_allocated_mb);
  if (r.parallel) out.emplace_back("comm_bytes", static_cast<double>(r.comm_bytes));
  return out;
}

std::unique_ptr<Metrics> main_metrics(const WatchedRun& run) {
  if (run.rank != 0) return nullptr;
  return std::make_unique<Metrics>(run.out_dir + "/metrics.jsonl", run.first_step - 1, run.c.metrics.tensorboard);
}

std::unique_ptr<ProgressLine> main_progress(const WatchedRun& run) {
  if (run.rank != 0) return nullptr;
  const TrainConfig& t = run.c.train;
  return std::make_unique<ProgressLine>(t.steps, t.log_every, run.log_prefix, run_label(run.c));
}

// Each rank's own memory and time per step, as a TensorBoard run of its own.
std::unique_ptr<TensorBoardWriter> rank_tensorboard(const WatchedRun& run) {
  if (run.c.metrics.tensorboard.empty()) return nullptr;
  return std::make_unique<TensorBoardWriter>(run.c.metrics.tensorboard + "/rank" + std::to_string(run.rank));
}

}  // namespace

StepWatch::StepWatch(WatchedRun run)
    : run_(std::move(run)),
      metrics_(main_metrics(run_)),
      progress_(main_progress(run_)),
      rank_tb_(rank_tensorboard(run_)),
      profiler_(run_.c.profile, run_.out_dir, run_.rank, run_.world_size, run_.cuda != nullptr, run_.barrier) {}

void StepWatch::begin(int64_t step) {
  profiler_.begin_step(step);  // its barrier before the counters' reset: not the step's communication
  start_ = std::chrono::steady_clock::now();
  recomputes_before_ = run_.ac ? run_.ac->recomputes() : 0;
  tcp_start_ = run_.world_size > 1 && is_main() ? tcp_tx_bytes() : -1;  // the logging rank's
  if (run_.reset_comm) run_.reset_comm();
  memory::reset_peak();
  if (run_.cuda) run_.cuda->reset_peaks(run_.device.index());
}

void StepWatch::end(int64_t step, StepRecord& r) {
  measure(r);
  profiler_.end_step(step);  // after the figures: its barrier and the trace's writing are not the step's
  report_trace(step);
  if (run_.ac) r.recomputes = run_.ac->recomputes() - recomputes_before_;
}

void StepWatch::show(const StepRecord& r) {
  if (metrics_) metrics_->record(r);
  if (progress_) progress_->show(r);
  if (rank_tb_) rank_tb_->scalars(r.step, rank_scalars(r));
}

// One step's figures beyond the step's own: time, throughput, memory and
// communication.
void StepWatch::measure(StepRecord& r) const {
  const int device = run_.device.index();
  if (run_.cuda) {  // the step's kernels are done before it is timed
    run_.cuda->synchronize(device);
    r.device_peak_allocated_mb = static_cast<double>(run_.cuda->peak_allocated(device)) / (1 << 20);
    r.device_peak_reserved_mb = static_cast<double>(run_.cuda->peak_reserved(device)) / (1 << 20);
  }
  r.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  r.samples_per_s = static_cast<double>(run_.c.train.global_batch) * 1000.0 / std::max(r.step_ms, 1e-9);
  if (run_.seq_len > 0) r.tokens_per_s = r.samples_per_s * static_cast<double>(run_.seq_len);
  r.peak_rss_mb = peak_rss_mb();
  r.peak_alloc_mb = static_cast<double>(memory::peak_bytes()) / (1 << 20);
  if (run_.add_comm) run_.add_comm(r);
  if (tcp_start_ >= 0) r.tcp_tx_bytes = tcp_tx_bytes() - tcp_start_;
}

// After the profiled range's last step, the main rank says where its trace is.
void StepWatch::report_trace(int64_t step) const {
  if (profiler_.path().empty() || step != run_.c.profile.steps[1] || !is_main()) return;
  std::cout << run_.log_prefix << "profile: steps " << run_.c.profile.steps[0] << "-" << step << " traced in "
            << (profiler_.merged_path().empty() ? profiler_.path() : profiler_.merged_path() + " (every rank)") << "\n";
}

}  // namespace composer

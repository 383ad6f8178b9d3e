#include "runner/observe/step_watch.h"

#include <algorithm>
#include <iostream>
#include <utility>
#include <vector>

#include "parallelisms/comm/flight_recorder.h"
#include "runner/base/memory.h"
#include "runner/observe/trackers.h"

namespace composer {
namespace {

// A rank's own figures of a step, for its TensorBoard run.
std::vector<std::pair<std::string, double>> rank_scalars(const StepRecord& r) {
  std::vector<std::pair<std::string, double>> out{{"step_ms", r.step_ms}, {"peak_rss_mb", r.peak_rss_mb}};
  if (r.peak_alloc_mb >= 0) out.emplace_back("peak_alloc_mb", r.peak_alloc_mb);
  if (r.device_peak_allocated_mb >= 0) out.emplace_back("device_peak_allocated_mb", r.device_peak_allocated_mb);
  if (r.parallel) out.emplace_back("comm_bytes", static_cast<double>(r.comm_bytes));
  if (r.comm_wait_ms >= 0) {
    out.emplace_back("compute_ms", r.compute_ms);
    out.emplace_back("comm_wait_ms", r.comm_wait_ms);
  }
  return out;
}

std::unique_ptr<Metrics> main_metrics(const WatchedRun& run) {
  if (run.rank != 0) return nullptr;
  auto trackers = Trackers::wanted(run.c) ? std::make_unique<Trackers>(run.c, run.out_dir, run.first_step - 1) : nullptr;
  return std::make_unique<Metrics>(run.out_dir + "/metrics.jsonl", run.first_step - 1, run.c.metrics.tensorboard,
                                   std::move(trackers));
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
  parallel::CommClock::take_ns();  // this step's time in collectives starts at zero
  memory::reset_peak();
  if (run_.cuda) run_.cuda->reset_peaks(run_.device.index());
}

void StepWatch::end(int64_t step, StepRecord& r) {
  measure(r);
  profiler_.end_step(step);  // after the figures: its barrier and the trace's writing are not the step's
  report_trace(step);
  if (run_.ac) r.recomputes = run_.ac->recomputes() - recomputes_before_;
}

void StepWatch::show(StepRecord& r) {
  compare_ranks(r);  // after the step's memory peak is taken and its trace closed: not the step's
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
  if (run_.gather_ranks) {
    r.comm_wait_ms = static_cast<double>(parallel::CommClock::take_ns()) / 1e6;
    r.compute_ms = std::max(0.0, r.step_ms - r.comm_wait_ms);
  }
}

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The median of every rank's figure but rank i's: what a rank is compared
// with. With itself in, a slow rank of two would be at most 2x the median
// however slow it is (1.33x when it takes twice as long).
double peers_median(const std::vector<double>& v, size_t i) {
  std::vector<double> peers;
  for (size_t j = 0; j < v.size(); ++j) {
    if (j != i) peers.push_back(v[j]);
  }
  return median(std::move(peers));
}

}  // namespace

// Every rank's step, compute and communication time; on the main rank, the
// stragglers. A rank delays its peers' step by as long as it computes (its
// step less its time in collectives) beyond them: they wait that long for it
// in the next collective. One whose compute time is above
// metrics.straggler_factor x its peers' median, and 10 ms above it, for
// metrics.straggler_steps steps in a row is named once, and again when it is
// back within the bar.
void StepWatch::compare_ranks(StepRecord& r) {
  if (!run_.gather_ranks) return;
  const std::vector<double> all = run_.gather_ranks({r.step_ms, r.compute_ms, r.comm_wait_ms});
  const size_t n = all.size() / 3;
  for (size_t i = 0; i < n; ++i) {
    r.rank_step_ms.push_back(all[3 * i]);
    r.rank_compute_ms.push_back(all[3 * i + 1]);
    r.rank_comm_wait_ms.push_back(all[3 * i + 2]);
  }
  if (!is_main() || n < 2) return;  // one rank has no peers to hold up
  const MetricsConfig& m = run_.c.metrics;
  slow_steps_.resize(n, 0);
  named_.resize(n, false);
  for (size_t i = 0; i < n; ++i) {
    const double ms = r.rank_compute_ms[i];
    const double mid = peers_median(r.rank_compute_ms, i);
    const bool above = ms > m.straggler_factor * mid && ms - mid > 10.0;
    slow_steps_[i] = above ? slow_steps_[i] + 1 : 0;
    char line[400];
    line[0] = 0;
    if (above && slow_steps_[i] >= m.straggler_steps && !named_[i]) {
      named_[i] = true;
      std::snprintf(line, sizeof line,
                    "straggler: rank %zu is %.1fx its peers' median step compute (%.1f ms against %.1f ms): it holds "
                    "their step up by about %.1f ms, for %lld steps in a row, to step %lld "
                    "(metrics.straggler_factor %.2f)",
                    i, ms / std::max(mid, 1e-9), ms, mid, ms - mid, static_cast<long long>(slow_steps_[i]),
                    static_cast<long long>(r.step), m.straggler_factor);
    } else if (!above && named_[i]) {
      named_[i] = false;
      std::snprintf(line, sizeof line,
                    "straggler: rank %zu is back within %.2fx its peers' median step compute at step %lld", i,
                    m.straggler_factor, static_cast<long long>(r.step));
    }
    if (line[0]) std::cout << run_.log_prefix << line << std::endl;
    if (named_[i]) r.stragglers.push_back(static_cast<int64_t>(i));
  }
}

// After the profiled range's last step, the main rank says where its trace is.
void StepWatch::report_trace(int64_t step) const {
  if (profiler_.path().empty() || step != run_.c.profile.steps[1] || !is_main()) return;
  std::cout << run_.log_prefix << "profile: steps " << run_.c.profile.steps[0] << "-" << step << " traced in "
            << (profiler_.merged_path().empty() ? profiler_.path() : profiler_.merged_path() + " (every rank)") << "\n";
}

}  // namespace composer

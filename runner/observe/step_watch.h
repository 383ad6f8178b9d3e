// What a run shows of each step, behind one watch the training loop calls:
// begin(step) before the step, end(step, record) after it (time, memory and
// communication measured, the profiler's step closed), show(record) once the
// record is complete (metrics.jsonl, the progress line, TensorBoard).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/comm/cuda_runtime.h"
#include "runner/config/config.h"
#include "runner/observe/metrics.h"
#include "runner/observe/profile.h"
#include "runner/observe/progress.h"
#include "runner/observe/tensorboard.h"

namespace composer {

// The run a watch looks at: its config, this rank and its device, where the
// outputs go, and what only the layers above can measure.
struct WatchedRun {
  const ExperimentConfig& c;  // train (steps, batch), metrics, profile; name and mesh for the label
  std::string out_dir;
  int rank = 0;
  int world_size = 1;
  std::string log_prefix;  // starts the main rank's lines
  int64_t first_step = 1;  // after a resume, the step after the checkpoint's
  int64_t seq_len = 0;     // tokens per sample for token models, else 0 (no tokens/s)
  c10::Device device = c10::kCPU;
  parallel::CudaRuntime* cuda = nullptr;  // a GPU run: its peaks, its kernels finished before the clock stops
  const parallel::ActivationCheckpoint* ac = nullptr;  // its recomputes per step
  std::function<void()> barrier;                       // waits for every rank (the profiler aligns clocks there)
  // The collectives' counters: zeroed as a step begins, added to its record
  // as it ends. Unset: a run without collectives.
  std::function<void()> reset_comm;
  std::function<void(StepRecord&)> add_comm;
  // Every rank's figures: this rank's in, all ranks' out (rank-major); unset
  // on one rank. A collective on the world group each step, in show(): after
  // the step's own figures (memory, communication, trace) are taken.
  std::function<std::vector<double>(const std::vector<double>&)> gather_ranks;
};

class StepWatch {
 public:
  // The main rank writes metrics.jsonl (and with metrics.tensorboard its
  // event file) and the progress line; with metrics.tensorboard every rank
  // also writes its own time and memory to <tensorboard>/rank<r>.
  explicit StepWatch(WatchedRun run);
  StepWatch(const StepWatch&) = delete;
  StepWatch& operator=(const StepWatch&) = delete;

  // Before the step: the profiler's step opened, the clock started, the
  // memory peaks and communication counters reset.
  void begin(int64_t step);
  // After the step: its time, throughput, memory and communication into `r`,
  // the profiler's step closed (the trace written after the last one).
  void end(int64_t step, StepRecord& r);
  // The complete record (eval included), with every rank's step, compute and
  // communication time gathered into it (a collective on the world group)
  // and the stragglers named: metrics, progress line, TensorBoard.
  void show(StepRecord& r);

 private:
  void measure(StepRecord& r) const;
  void compare_ranks(StepRecord& r);
  void report_trace(int64_t step) const;
  bool is_main() const { return run_.rank == 0; }

  WatchedRun run_;
  // Declared in the order they start; they finish in reverse (the profiler
  // first, metrics.jsonl last).
  std::unique_ptr<Metrics> metrics_;        // the main rank's
  std::unique_ptr<ProgressLine> progress_;  // the main rank's
  std::unique_ptr<TensorBoardWriter> rank_tb_;
  StepProfiler profiler_;
  std::chrono::steady_clock::time_point start_;
  int64_t recomputes_before_ = 0;
  double tcp_start_ = -1;  // the logging rank's TCP bytes sent before the step; -1 not counted
  std::vector<int64_t> slow_steps_;  // the main rank's: each rank's steps in a row above the straggler bar
  std::vector<bool> named_;          // each rank is named a straggler now
};

}  // namespace composer

#pragma once
// profile: the PyTorch profiler (Kineto) over a range of steps. Each rank
// writes <dir>/kineto.rank<R>.json, a Chrome trace (chrome://tracing,
// ui.perfetto.dev) of its operators and, on cuda, its kernels and copies on
// every stream, with each profiled step as a "step N" annotation and
// composer's own spans (collectives with their group and bytes, unit
// forwards, pipeline actions, recomputes, the optimizer step). Rank 0 then
// merges them into <dir>/trace.json: one process per rank (and one per rank's
// device), clocks aligned at a barrier. tools/trace-overlap reads either.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "runner/config/config.h"

namespace at {
class RecordFunction;
}

namespace composer {

class StepProfiler {
 public:
  // Off when c.steps is empty. `cuda`: record the device's activity too.
  // `barrier` waits for every rank (a no-op alone).
  StepProfiler(const ProfileConfig& c, const std::string& out_dir, int rank, int world_size, bool cuda,
               std::function<void()> barrier);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Around each step: starts the profiler before the first chosen step, marks
  // every chosen step, and writes the trace after the last one (the device's
  // work must be finished by then).
  void begin_step(int64_t step);
  void end_step(int64_t step);

  // This rank's trace (empty when off), and the merged one (rank 0's job).
  const std::string& path() const { return path_; }
  const std::string& merged_path() const { return merged_; }

 private:
  int64_t first_ = 0, last_ = -1;
  bool cuda_ = false;
  bool on_ = false;
  int rank_ = 0, world_ = 1;
  std::function<void()> barrier_;
  std::string dir_, path_, merged_;
  std::string mark_name_;
  std::unique_ptr<at::RecordFunction> mark_;  // the open step's annotation
};

// Merges the ranks' kineto.rank<R>.json in `dir` into one Chrome trace at
// `out` (see above); returns its event count.
int64_t merge_traces(const std::string& dir, int world_size, const std::string& out);

}  // namespace composer

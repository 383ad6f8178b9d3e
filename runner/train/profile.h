#pragma once
// profile: the PyTorch profiler (Kineto) over a range of steps. Each rank
// writes <dir>/kineto.rank<R>.json, a Chrome trace (chrome://tracing,
// ui.perfetto.dev) of its operators and, on cuda, its kernels and copies on
// every stream, with each profiled step as a "step N" annotation.
// tools/trace-overlap reads it.

#include <cstdint>
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
  StepProfiler(const ProfileConfig& c, const std::string& out_dir, int rank, bool cuda);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Around each step: starts the profiler before the first chosen step, marks
  // every chosen step, and writes the trace after the last one (the device's
  // work must be finished by then).
  void begin_step(int64_t step);
  void end_step(int64_t step);

  // The trace's path (empty when off).
  const std::string& path() const { return path_; }

 private:
  int64_t first_ = 0, last_ = -1;
  bool cuda_ = false;
  bool on_ = false;
  std::string path_;
  std::string mark_name_;
  std::unique_ptr<at::RecordFunction> mark_;  // the open step's annotation
};

}  // namespace composer

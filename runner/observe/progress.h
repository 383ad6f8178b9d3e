// The progress line: one readable line per logged step on the main rank
// ("step 2/5  loss ...  ETA ...  ms  tokens/s  MiB  grad_norm  lr  name"), or
// a bar rewritten in place when stdout is a terminal.
#pragma once
#include <cstdint>
#include <string>

#include "runner/config/config.h"
#include "runner/observe/metrics.h"

namespace composer {

// "name (dp2 x tp2)": the experiment and its mesh, which end the line.
std::string run_label(const ExperimentConfig& c);

class ProgressLine {
 public:
  // `log_prefix` starts every line (e.g. "[rank 0/1] "), `label` ends it. Off
  // a terminal, a line is printed every `log_every` steps, at the first and
  // the last step and after each eval.
  ProgressLine(int64_t total_steps, int64_t log_every, std::string log_prefix, std::string label);
  ~ProgressLine();  // ends the bar's line on a terminal
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  void show(const StepRecord& r);

 private:
  // The line's text without prefix or bar; the ETA from this run's steps so far.
  std::string text(const StepRecord& r) const;
  void draw_bar(const StepRecord& r, const std::string& line) const;

  int64_t total_, every_;
  std::string prefix_, label_;
  bool tty_;
  int64_t first_ = -1;     // the first step this run showed
  double elapsed_ms_ = 0;  // its steps' time so far, for the ETA
};

}  // namespace composer

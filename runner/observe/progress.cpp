#include "runner/observe/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace composer {
namespace {

// "1h05m" or "3m07s".
std::string eta_text(double eta_s) {
  char eta[32];
  if (eta_s >= 3600) {
    std::snprintf(eta, sizeof eta, "%dh%02dm", static_cast<int>(eta_s / 3600), static_cast<int>(eta_s / 60) % 60);
  } else {
    std::snprintf(eta, sizeof eta, "%dm%02ds", static_cast<int>(eta_s / 60), static_cast<int>(eta_s) % 60);
  }
  return eta;
}

// Tokens per second for token models, else samples per second.
std::string rate_text(const StepRecord& r) {
  char rate[48];
  if (r.tokens_per_s > 0) {
    std::snprintf(rate, sizeof rate, "%.0f tokens/s", r.tokens_per_s);
  } else {
    std::snprintf(rate, sizeof rate, "%.0f samples/s", r.samples_per_s);
  }
  return rate;
}

// The memory the line shows: the device's peak, else the counted tensors'
// peak, else the resident set.
double shown_mb(const StepRecord& r) {
  return r.device_peak_allocated_mb >= 0 ? r.device_peak_allocated_mb
         : r.peak_alloc_mb >= 0          ? r.peak_alloc_mb
                                         : r.peak_rss_mb;
}

}  // namespace

std::string run_label(const ExperimentConfig& c) {
  std::string mesh;
  for (size_t i = 0; i < c.mesh.shape.size(); ++i) {
    mesh += (i ? " x " : "") + (i < c.mesh.names.size() ? c.mesh.names[i] : "") + std::to_string(c.mesh.shape[i]);
  }
  return c.name + (mesh.empty() || c.mesh.world_size() == 1 ? "" : " (" + mesh + ")");
}

ProgressLine::ProgressLine(int64_t total, int64_t every, std::string prefix, std::string label)
    : total_(total), every_(every), prefix_(std::move(prefix)), label_(std::move(label)), tty_(isatty(STDOUT_FILENO)) {}

ProgressLine::~ProgressLine() {
  if (tty_) std::printf("\n");
}

std::string ProgressLine::text(const StepRecord& r) const {
  const double eta_s =
      elapsed_ms_ / static_cast<double>(r.step - first_ + 1) * static_cast<double>(total_ - r.step) / 1e3;
  const double mem_mb = shown_mb(r);
  char eval[48] = "";
  if (r.has_eval) std::snprintf(eval, sizeof eval, "  eval_loss %.6g", r.eval_loss);
  char line[448];
  std::snprintf(line, sizeof line,
                "step %lld/%lld  loss %.6g%s  ETA %s  %.1f ms  %s  %.*f MiB%s  grad_norm %.4g  lr %.3g  %s",
                static_cast<long long>(r.step), static_cast<long long>(total_), r.loss, eval, eta_text(eta_s).c_str(),
                r.step_ms, rate_text(r).c_str(), mem_mb < 10 ? 2 : 0, mem_mb,
                r.device_peak_allocated_mb >= 0 ? " on the device" : "", r.grad_norm, r.lr, label_.c_str());
  return line;
}

// One line, rewritten in place and cut to the terminal's width.
void ProgressLine::draw_bar(const StepRecord& r, const std::string& line) const {
  const int width = 24;
  int done = static_cast<int>(width * r.step / std::max<int64_t>(1, total_));
  std::string text = prefix_ + "[" + std::string(done, '#') + std::string(width - done, '.') + "] " + line;
  winsize ws{};
  if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 && text.size() >= ws.ws_col) {
    text.resize(ws.ws_col - 1);
  }
  std::printf("\r%s\033[K", text.c_str());
  std::fflush(stdout);
}

void ProgressLine::show(const StepRecord& r) {
  if (first_ < 0) first_ = r.step;
  elapsed_ms_ += r.step_ms;
  const std::string line = text(r);
  if (tty_) {
    draw_bar(r, line);
  } else if (r.step % every_ == 0 || r.step == total_ || r.step == 1 || r.has_eval) {
    std::printf("%s%s\n", prefix_.c_str(), line.c_str());
    std::fflush(stdout);
  }
}

}  // namespace composer

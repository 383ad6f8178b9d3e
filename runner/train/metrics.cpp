#include "runner/train/metrics.h"

#include <dirent.h>
#include <linux/tcp.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "runner/base/errors.h"
#include "runner/train/tensorboard.h"

namespace composer {

double peak_rss_mb() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f) {
    char line[256];
    long kb = -1;
    while (std::fgets(line, sizeof line, f)) {
      if (std::sscanf(line, "VmHWM: %ld kB", &kb) == 1) break;
    }
    std::fclose(f);
    if (kb >= 0) return static_cast<double>(kb) / 1024.0;
  }
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

void reset_peak_rss() {
  malloc_trim(0);
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", f);  // resets VmHWM to the current RSS
    std::fclose(f);
  }
}

double tcp_tx_bytes() {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  double sent = 0;
  bool counted = false;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    tcp_info info{};
    socklen_t len = sizeof info;
    if (getsockopt(static_cast<int>(fd), IPPROTO_TCP, TCP_INFO, &info, &len) != 0) continue;  // not a TCP socket
    if (len < offsetof(tcp_info, tcpi_bytes_sent) + sizeof info.tcpi_bytes_sent) continue;   // an old kernel
    sent += static_cast<double>(info.tcpi_bytes_sent);
    counted = true;
  }
  closedir(dir);
  return counted ? sent : -1;
}

namespace {

// The lines of `path` whose step is at most `step`.
std::string history_until(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      auto j = nlohmann::json::parse(line);
      if (j.value("step", int64_t{0}) <= step) kept += line + "\n";
    } catch (const nlohmann::json::exception&) {  // a line cut short by a crash
    }
  }
  return kept;
}

}  // namespace

std::vector<std::pair<std::string, double>> scalars_of(const nlohmann::json& line) {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& [key, v] : line.items()) {
    if (key == "step") continue;
    if (v.is_number()) out.emplace_back(key, v.get<double>());
    if (v.is_object()) {
      for (const auto& [name, x] : v.items()) {
        if (x.is_number()) out.emplace_back(key + "/" + name, x.get<double>());
      }
    }
    if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (v[i].is_number()) out.emplace_back(key + "/" + std::to_string(i), v[i].get<double>());
      }
    }
  }
  return out;
}

Metrics::Metrics(const std::string& path, int64_t total, int64_t every, std::string prefix, std::string label,
                 int64_t resumed_at, const std::string& tensorboard)
    : total_(total), every_(every), prefix_(std::move(prefix)), label_(std::move(label)), tty_(isatty(STDOUT_FILENO)) {
  const std::string history = resumed_at > 0 ? history_until(path, resumed_at) : "";
  jsonl_.open(path, std::ios::trunc);
  if (!jsonl_) throw RuntimeFailure("cannot write metrics file " + path);
  jsonl_ << history;
  if (!tensorboard.empty()) tb_ = std::make_unique<TensorBoardWriter>(tensorboard);
}

Metrics::~Metrics() {
  if (tty_) std::printf("\n");
}

void Metrics::record(const StepRecord& r) {
  nlohmann::json j = {{"step", r.step},
                      {"loss", r.loss},
                      {"grad_norm", r.grad_norm},
                      {"lr", r.lr},
                      {"step_ms", r.step_ms},
                      {"forward_ms", r.forward_ms},
                      {"backward_ms", r.backward_ms},
                      {"optimizer_ms", r.optimizer_ms},
                      {"samples_per_s", r.samples_per_s},
                      {"peak_rss_mb", r.peak_rss_mb}};
  if (r.has_eval) j["eval_loss"] = r.eval_loss;
  if (r.recomputes >= 0) j["recomputes"] = r.recomputes;
  if (r.skipped) j["skipped"] = true;
  if (r.pipeline_bubble >= 0) {
    j["pipeline_bubble"] = r.pipeline_bubble;
    j["pipeline_bubble_formula"] = r.pipeline_bubble_formula;
    j["microbatch_losses"] = r.microbatch_losses;
  }
  if (r.peak_alloc_mb >= 0) j["peak_alloc_mb"] = r.peak_alloc_mb;
  if (r.device_peak_allocated_mb >= 0) {
    j["device_peak_allocated_mb"] = r.device_peak_allocated_mb;
    j["device_peak_reserved_mb"] = r.device_peak_reserved_mb;
  }
  if (r.tokens_per_s > 0) j["tokens_per_s"] = r.tokens_per_s;
  if (r.parallel) {
    j["comm_calls"] = r.comm_calls;
    j["comm_bytes"] = r.comm_bytes;
    j["comm_ring_bytes"] = r.comm_ring_bytes;
    if (r.tcp_tx_bytes >= 0) j["tcp_tx_bytes"] = r.tcp_tx_bytes;
    if (!r.comm_bytes_by_group.empty()) j["comm_bytes_by_group"] = r.comm_bytes_by_group;
  }
  jsonl_ << j.dump() << "\n";
  jsonl_.flush();
  if (tb_) tb_->scalars(r.step, scalars_of(j));

  if (first_ < 0) first_ = r.step;
  elapsed_ms_ += r.step_ms;
  const double eta_s = elapsed_ms_ / static_cast<double>(r.step - first_ + 1) * static_cast<double>(total_ - r.step) / 1e3;
  char eta[32];
  if (eta_s >= 3600) {
    std::snprintf(eta, sizeof eta, "%dh%02dm", static_cast<int>(eta_s / 3600), static_cast<int>(eta_s / 60) % 60);
  } else {
    std::snprintf(eta, sizeof eta, "%dm%02ds", static_cast<int>(eta_s / 60), static_cast<int>(eta_s) % 60);
  }
  char rate[48];
  if (r.tokens_per_s > 0) {
    std::snprintf(rate, sizeof rate, "%.0f tokens/s", r.tokens_per_s);
  } else {
    std::snprintf(rate, sizeof rate, "%.0f samples/s", r.samples_per_s);
  }
  const double mem_mb = r.device_peak_allocated_mb >= 0 ? r.device_peak_allocated_mb
                        : r.peak_alloc_mb >= 0           ? r.peak_alloc_mb
                                                         : r.peak_rss_mb;
  char eval[48] = "";
  if (r.has_eval) std::snprintf(eval, sizeof eval, "  eval_loss %.6g", r.eval_loss);
  char line[448];
  std::snprintf(line, sizeof line,
                "step %lld/%lld  loss %.6g%s  ETA %s  %.1f ms  %s  %.*f MiB%s  grad_norm %.4g  lr %.3g  %s",
                static_cast<long long>(r.step), static_cast<long long>(total_), r.loss, eval, eta, r.step_ms, rate,
                mem_mb < 10 ? 2 : 0, mem_mb, r.device_peak_allocated_mb >= 0 ? " on the device" : "", r.grad_norm, r.lr,
                label_.c_str());
  if (tty_) {  // one line, rewritten in place and cut to the terminal's width
    const int width = 24;
    int done = static_cast<int>(width * r.step / std::max<int64_t>(1, total_));
    std::string text = prefix_ + "[" + std::string(done, '#') + std::string(width - done, '.') + "] " + line;
    winsize ws{};
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 && text.size() >= ws.ws_col) {
      text.resize(ws.ws_col - 1);
    }
    std::printf("\r%s\033[K", text.c_str());
    std::fflush(stdout);
  } else if (r.step % every_ == 0 || r.step == total_ || r.step == 1 || r.has_eval) {
    std::printf("%s%s\n", prefix_.c_str(), line);
    std::fflush(stdout);
  }
}

}  // namespace composer

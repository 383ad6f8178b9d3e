#include "runner/observe/metrics.h"

#include <dirent.h>
#include <linux/tcp.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "runner/base/errors.h"
#include "runner/observe/tensorboard.h"
#include "runner/observe/trackers.h"

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
    if (len < offsetof(tcp_info, tcpi_bytes_sent) + sizeof info.tcpi_bytes_sent) continue;    // an old kernel
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

namespace {

// The figures only some runs have, each under its condition.
void add_optional(nlohmann::json& j, const StepRecord& r) {
  if (r.has_eval) j["eval_loss"] = r.eval_loss;
  if (r.recomputes >= 0) j["recomputes"] = r.recomputes;
  if (r.expert_imbalance >= 0) {
    j["expert_tokens"] = r.expert_tokens;
    j["expert_imbalance"] = r.expert_imbalance;
  }
  if (r.expert_dropped >= 0) j["expert_dropped"] = r.expert_dropped;
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
}

// A multi-rank run's communication, as the logging rank saw it.
void add_communication(nlohmann::json& j, const StepRecord& r) {
  if (!r.parallel) return;
  j["comm_calls"] = r.comm_calls;
  j["comm_bytes"] = r.comm_bytes;
  j["comm_ring_bytes"] = r.comm_ring_bytes;
  if (r.tcp_tx_bytes >= 0) j["tcp_tx_bytes"] = r.tcp_tx_bytes;
  if (!r.comm_bytes_by_group.empty()) j["comm_bytes_by_group"] = r.comm_bytes_by_group;
  if (r.comm_wait_ms >= 0) {
    j["comm_wait_ms"] = r.comm_wait_ms;
    j["compute_ms"] = r.compute_ms;
  }
  if (!r.rank_step_ms.empty()) {
    j["rank_step_ms"] = r.rank_step_ms;
    j["rank_compute_ms"] = r.rank_compute_ms;
    j["rank_comm_wait_ms"] = r.rank_comm_wait_ms;
    j["stragglers"] = r.stragglers;
  }
}

}  // namespace

nlohmann::json metrics_line(const StepRecord& r) {
  nlohmann::json j = {{"step", r.step},
                      {"loss", r.loss},
                      {"grad_norm", r.grad_norm},
                      {"lr", r.lr},
                      {"step_ms", r.step_ms},
                      {"forward_ms", r.forward_ms},
                      {"backward_ms", r.backward_ms},
                      {"optimizer_ms", r.optimizer_ms},
                      {"data_wait_ms", r.data_wait_ms},
                      {"samples_per_s", r.samples_per_s},
                      {"peak_rss_mb", r.peak_rss_mb}};
  add_optional(j, r);
  add_communication(j, r);
  return j;
}

Metrics::Metrics(const std::string& path, int64_t resumed_at, const std::string& tensorboard,
                 std::unique_ptr<Trackers> trackers)
    : trackers_(std::move(trackers)) {
  const std::string history = resumed_at > 0 ? history_until(path, resumed_at) : "";
  jsonl_.open(path, std::ios::trunc);
  if (!jsonl_) throw RuntimeFailure("cannot write metrics file " + path);
  jsonl_ << history;
  if (!tensorboard.empty()) tb_ = std::make_unique<TensorBoardWriter>(tensorboard);
}

Metrics::~Metrics() = default;

void Metrics::record(const StepRecord& r) {
  const nlohmann::json j = metrics_line(r);
  jsonl_ << j.dump() << "\n";
  jsonl_.flush();
  if (tb_ || trackers_) {
    const auto scalars = scalars_of(j);
    if (tb_) tb_->scalars(r.step, scalars);
    if (trackers_) trackers_->scalars(r.step, scalars);
  }
}

}  // namespace composer

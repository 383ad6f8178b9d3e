#include "runner/base/errors.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <ctime>

#include <algorithm>
#include <iostream>
#include <sstream>
#include <vector>

namespace composer {

std::string SourceRef::where() const {
  std::ostringstream os;
  if (!override.empty()) {
    os << "--set " << override;
  } else {
    os << (file.empty() ? "<config>" : file);
    if (line > 0) os << ":" << line << ":" << col;
  }
  if (!path.empty()) os << ": " << path;
  return os.str();
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

namespace {
volatile sig_atomic_t g_stop = 0;
volatile sig_atomic_t g_stop_at_s = 0;  // when the first request came (monotonic seconds)
// A terminal's Ctrl-C reaches the ranks and composer's launcher, which passes
// it on as SIGTERM: a request within a second of the first is the same one.
void on_stop(int sig) {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  if (g_stop && now.tv_sec > g_stop_at_s + 1) {  // a second request: now
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  if (!g_stop) g_stop_at_s = static_cast<sig_atomic_t>(now.tv_sec);
  g_stop = 1;
}
}  // namespace

void install_stop_handlers() {
  std::signal(SIGTERM, on_stop);
  std::signal(SIGINT, on_stop);
}

bool stop_requested() { return g_stop != 0; }

void flush_output() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
}

void exit_flushed(int code) {
  flush_output();
  _exit(code);
}

}  // namespace composer

#include "runner/observe/trackers.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "runner/base/errors.h"
#include "runner/base/python_tool.h"

extern char** environ;

namespace composer {

Trackers::Trackers(const ExperimentConfig& c, const std::string& out_dir, int64_t resumed_at) {
  std::vector<std::string> args{python_program(), tool_script("track.py"), "--out-dir", out_dir,
                                "--config", out_dir + "/config.resolved.json", "--resumed-at",
                                std::to_string(resumed_at)};
  if (c.metrics.wandb) {
    const WandbConfig& w = *c.metrics.wandb;
    args.push_back("--wandb");
    args.push_back(nlohmann::json{{"project", w.project}, {"entity", w.entity}, {"name", w.name}, {"mode", w.mode}}.dump());
  }
  if (c.metrics.mlflow) {
    const MlflowConfig& m = *c.metrics.mlflow;
    args.push_back("--mlflow");
    args.push_back(nlohmann::json{{"tracking_uri", m.tracking_uri}, {"experiment", m.experiment}}.dump());
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw RuntimeFailure(std::string("cannot start tools/track.py: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[0], 0);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int err = posix_spawnp(&pid_, argv[0], &actions, nullptr, argv.data(), environ);  // COMPOSER_PYTHON may be a name on PATH
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[0]);
  if (err != 0) {
    ::close(fds[1]);
    throw UserError("cannot start " + args[0] + " for metrics.wandb / metrics.mlflow: " + std::strerror(err) +
                    "; run tools/setup, or point COMPOSER_PYTHON at a Python with wandb and mlflow");
  }
  fd_ = fds[1];
  signal(SIGPIPE, SIG_IGN);  // a sidecar that stopped is a write error, said once, not a signal
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
}

void Trackers::send(const std::string& line) {
  if (fd_ < 0) return;
  const ssize_t n = ::write(fd_, line.data(), line.size());
  if (n == static_cast<ssize_t>(line.size())) return;
  if (n < 0 && errno == EAGAIN && !dropped_) {  // the sidecar is behind: this line goes, the next may fit
    dropped_ = true;
    std::cerr << "warning: metrics.wandb/mlflow: the tracker sidecar fell behind; dropping the lines its input "
                 "cannot take (this warning is not repeated)\n";
    return;
  }
  if (n < 0 && errno == EAGAIN) return;
  std::cerr << "warning: metrics.wandb/mlflow: the tracker sidecar (tools/track.py) stopped taking input (" <<
               (n < 0 ? std::strerror(errno) : "a partial write") << "); no more tracker logging, training goes on\n";
  ::close(fd_);
  fd_ = -1;
}

void Trackers::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [tag, v] : values) list.push_back({tag, v});
  send(nlohmann::json{{"step", step}, {"scalars", list}}.dump() + "\n");
}

Trackers::~Trackers() {
  if (fd_ >= 0) {
    fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) & ~O_NONBLOCK);  // the last line waits for room
    const std::string end = std::uncaught_exceptions() > 0 ? "FAILED" : "FINISHED";
    const std::string line = nlohmann::json{{"end", end}}.dump() + "\n";
    if (::write(fd_, line.data(), line.size()) < 0) {}  // a sidecar that stopped ends its runs itself
    ::close(fd_);
  }
  if (pid_ <= 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int status = 0;
  while (waitpid(pid_, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      std::cerr << "warning: metrics.wandb/mlflow: the tracker sidecar did not finish within 60 s of the end of "
                   "training (an upload that cannot reach its server); stopped it. An offline wandb run uploads "
                   "later with `wandb sync`\n";
      kill(pid_, SIGTERM);
      waitpid(pid_, &status, 0);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace composer

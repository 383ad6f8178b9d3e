#include "runner/launch/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include "runner/base/errors.h"
#include "runner/launch/flight_report.h"
#include "runner/launch/rendezvous.h"

namespace composer {
namespace {

constexpr auto kGrace = std::chrono::seconds(5);  // SIGTERM to SIGKILL after a rank failed
// Asked to stop, the ranks finish their step and save a checkpoint first.
constexpr auto kStopGrace = std::chrono::seconds(120);
constexpr int kStoppedCode = 4;  // a rank that stopped on request (errors.h Stopped)

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) throw UserError(std::string("environment variable ") + name + "='" + v + "' is not a non-negative integer");
  return static_cast<int>(x);
}

struct Child : RankProcess {
  int rank = 0;
  int out_fd = -1, err_fd = -1;
  std::string out_buf, err_buf;
  int64_t died_ns = 0;  // when it was found dead (CLOCK_MONOTONIC, as ranks stamp their errors)
};

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) {
  if (g_interrupted < 2) ++g_interrupted;  // the second: stop the ranks at once
}

// Forwards complete lines from `fd` with the rank prefix; returns false at EOF.
bool pump(int fd, std::string& buf, std::ostream& os, const std::string& prefix) {
  char chunk[4096];
  ssize_t n = read(fd, chunk, sizeof chunk);
  if (n <= 0) {
    if (!buf.empty()) os << prefix << buf << "\n" << std::flush;
    buf.clear();
    return n < 0 && errno == EAGAIN;
  }
  buf.append(chunk, static_cast<size_t>(n));
  size_t pos;
  while ((pos = buf.find_first_of("\n\r")) != std::string::npos) {
    if (pos > 0) os << prefix << buf.substr(0, pos) << "\n";
    buf.erase(0, pos + 1);
  }
  os << std::flush;
  return true;
}

// Whether this process runs one thread: a child forked from it then holds all
// of it, with no lock or thread pool (OpenMP's, a store's server) half copied.
bool single_threaded() {
  std::error_code ec;
  int threads = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/task", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++threads;
  }
  return !ec && threads == 1;
}

// Starts one rank. With `entry`, a launcher that runs one thread forks the
// rank and calls entry() in the child: the libraries are loaded and
// registered already, which saves each rank the executable's start (about
// 0.35 s of a core with LibTorch). Otherwise the child executes composer
// again, as it always may.
pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env,
            int out[2], int err[2], const RankEntry& entry) {
  const bool in_place = entry && single_threaded();
  flush_output();  // else the child would write the launcher's pending output again
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw RuntimeFailure(std::string("fork failed: ") + std::strerror(errno));
  if (pid > 0) return pid;
  // Child: die with the launcher, write into the pipes, become the rank.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(3);
  dup2(out[1], STDOUT_FILENO);
  dup2(err[1], STDERR_FILENO);
  close(out[0]);
  close(err[0]);
  for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
  if (in_place) {
    signal(SIGINT, SIG_DFL);  // the launcher's handlers; the rank installs its own
    signal(SIGTERM, SIG_DFL);
    exit_flushed(entry());
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv("/proc/self/exe", args.data());
  std::fprintf(stderr, "cannot start rank: %s\n", std::strerror(errno));
  _exit(3);
}

// Why the job failed: the first failing rank, the exit code the launcher
// returns and the message it prints.
struct Cause {
  int rank = -1;
  int exit_code = 0;  // what the launcher returns
  std::string message;
  int64_t at = 0;
};

// Which rank caused a failure. A rank stopped (SIGSTOP, a debugger) and never
// resumed comes first (its peers time out waiting for it and report first),
// then a rank killed by a signal the launcher did not send (its peers' lost
// connections are often stamped before it is found dead), then a rank that exited non-zero without reporting an error,
// then the earliest error a rank reported, and last a rank killed by SIGPIPE:
// it wrote to a connection a peer had closed, the peer's exit (a bad input's
// exit 2) being the cause. Empty when every rank succeeded.
// When the job was interrupted, the interrupting signals (a terminal's Ctrl-C
// reaches every rank too) are not causes.
Cause failure_cause(const std::vector<Child>& kids, const std::string& error_dir, bool interrupted) {
  Cause frozen, signalled, silent, reported, broken_pipe;
  auto keep = [](Cause& slot, const Cause& c) {
    if (slot.rank < 0 || c.at < slot.at) slot = c;
  };
  for (const auto& c : kids) {
    const std::string who = "rank " + std::to_string(c.rank);
    int64_t t = 0;
    int code = 0;
    std::ifstream in(error_dir + "/" + std::to_string(c.rank));
    const bool stamped = !error_dir.empty() && static_cast<bool>(in >> t >> code) && code != 0;
    const bool interruption =
        interrupted && (c.signal == SIGINT || c.signal == SIGTERM || c.signal == SIGHUP || c.sent != 0);
    if (interruption) continue;
    if (c.frozen || (!c.done && c.stopped)) {
      const char* abbrev = sigabbrev_np(c.stopped);
      keep(frozen, {c.rank, 3,
                    who + " was stopped by signal " + std::to_string(c.stopped) +
                        (abbrev ? " (SIG" + std::string(abbrev) + ")" : std::string()) +
                        " and never resumed; its peers timed out waiting for it (mesh.timeout_s); stopped the "
                        "other ranks",
                    c.died_ns});
    } else if (c.signal) {
      const char* abbrev = sigabbrev_np(c.signal);
      keep(c.signal == SIGPIPE ? broken_pipe : signalled, {c.rank, 3,
                       who + " was killed by signal " + std::to_string(c.signal) +
                           (abbrev ? " (SIG" + std::string(abbrev) + ")" : std::string()) + "; stopped the other ranks",
                       c.died_ns});
    } else if (c.code != 0 && !stamped && c.sent == 0) {
      keep(silent, {c.rank, 3,
                    who + " exited with code " + std::to_string(c.code) +
                        " without reporting an error; stopped the other ranks",
                    c.died_ns});
    } else if (stamped) {
      keep(reported, {c.rank, (code == 1 || code == 2 || code == 5) ? code : 3,
                      who + " failed with exit code " + std::to_string(code) +
                          (code == 1 ? "" : "; stopped the other ranks"),
                      t});
    }
  }
  if (frozen.rank >= 0) return frozen;
  if (signalled.rank >= 0) return signalled;
  if (silent.rank >= 0) return silent;
  if (reported.rank >= 0) return reported;
  return broken_pipe;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

// Refuses a node layout the mesh's ranks cannot be spread over.
void check_node_options(int world_size, const NodeOptions& node) {
  if (node.nnodes < 1 || world_size % node.nnodes != 0) {
    throw UserError("--nnodes " + std::to_string(node.nnodes) + " does not divide the mesh's " +
                    std::to_string(world_size) + " ranks; use a divisor of " + std::to_string(world_size));
  }
  if (node.node_rank < 0 || node.node_rank >= node.nnodes) {
    throw UserError("--node-rank " + std::to_string(node.node_rank) + " must be below --nnodes " +
                    std::to_string(node.nnodes));
  }
  if (node.nnodes > 1 && node.master_port == 0) {
    throw UserError("--nnodes " + std::to_string(node.nnodes) + " needs --master-port so the nodes can meet");
  }
}

// What the launcher tells every rank it starts on this node about the job.
struct JobLayout {
  int world_size = 0;
  int local = 0;  // ranks on this node
  int node_rank = 0;
  std::string master_addr;
  int port = 0;  // where the rendezvous store listens
  std::string error_dir;
  bool file_store = false;  // the ranks meet through a file store in error_dir
  int attempt = 0;          // 0, then one more for each restart
};

// The environment of the rank with `local_rank` on this node, as rank_env_from_environment reads it.
std::vector<std::pair<std::string, std::string>> rank_environment(const JobLayout& job, int rank, int local_rank) {
  std::vector<std::pair<std::string, std::string>> env = {
      {"RANK", std::to_string(rank)},             {"WORLD_SIZE", std::to_string(job.world_size)},
      {"LOCAL_RANK", std::to_string(local_rank)}, {"LOCAL_WORLD_SIZE", std::to_string(job.local)},
      {"MASTER_ADDR", job.master_addr},           {"MASTER_PORT", std::to_string(job.port)},
      {"COMPOSER_LAUNCHED", "1"},                 {"GLOG_minloglevel", "2"},
      {"COMPOSER_ERROR_DIR", job.error_dir},      {"COMPOSER_ATTEMPT", std::to_string(job.attempt)}};
  if (job.file_store) env.emplace_back("COMPOSER_STORE_FILE", job.error_dir + "/store");
  // OpenBLAS sizes its thread pool when it loads, from the environment: give
  // each rank its share of the cores, or its spinning threads fight the
  // other ranks for them (the trainer sets LibTorch's threads the same way).
  if (!std::getenv("OPENBLAS_NUM_THREADS")) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    env.emplace_back("OPENBLAS_NUM_THREADS", std::to_string(std::max(1, cores / job.local)));
  }
  return env;
}

// Starts this node's ranks, each writing into non-blocking pipes the launcher reads.
std::vector<Child> spawn_ranks(const JobLayout& job, const std::vector<std::string>& argv, const RankEntry& entry) {
  std::vector<Child> kids(job.local);
  for (int i = 0; i < job.local; ++i) {
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) throw RuntimeFailure("cannot create pipes for the ranks");
    Child& c = kids[i];
    c.rank = job.node_rank * job.local + i;
    c.pid = spawn(argv, rank_environment(job, c.rank, i), out, err, entry);
    close(out[1]);
    close(err[1]);
    c.out_fd = out[0];
    c.err_fd = err[0];
    fcntl(c.out_fd, F_SETFL, O_NONBLOCK);
    fcntl(c.err_fd, F_SETFL, O_NONBLOCK);
  }
  return kids;
}

// Waits a little for output from any rank, so that the supervising loop does not spin.
void wait_for_output(const std::vector<Child>& kids) {
  std::vector<pollfd> fds;
  for (const auto& c : kids) {
    if (c.out_fd >= 0) fds.push_back({c.out_fd, POLLIN, 0});
    if (c.err_fd >= 0) fds.push_back({c.err_fd, POLLIN, 0});
  }
  if (!fds.empty()) poll(fds.data(), fds.size(), 100);
  else std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// Forwards the rank's pending output and, when it has just exited, records how; returns whether it just exited.
bool tend(Child& c, int world_size) {
  const std::string prefix = "[rank " + std::to_string(c.rank) + "/" + std::to_string(world_size) + "] ";
  if (c.out_fd >= 0 && !pump(c.out_fd, c.out_buf, std::cout, prefix)) { close(c.out_fd); c.out_fd = -1; }
  if (c.err_fd >= 0 && !pump(c.err_fd, c.err_buf, std::cerr, prefix)) { close(c.err_fd); c.err_fd = -1; }
  if (c.done || !watch_process(c)) return false;
  c.died_ns = monotonic_ns();
  return true;
}

// Sends `sig` to every rank still running, remembering it as the launcher's.
// Before the first SIGKILL, a rank last seen stopped is looked at again: a
// continue waitpid has not reported yet must not make it frozen (after it,
// a dying rank is no longer stopped).
void signal_running(std::vector<Child>& kids, int sig) {
  for (auto& c : kids) {
    if (c.done) continue;
    if (sig == SIGKILL && c.sent != SIGKILL && c.stopped && !process_is_stopped(c.pid)) c.stopped = 0;
    kill(c.pid, c.sent = sig);
  }
}

// Forwards the ranks' output until all have exited and their pipes are drained. Once one exits non-zero or the
// launcher is interrupted, the others get SIGTERM, and SIGKILL after kGrace.
void supervise(std::vector<Child>& kids, int world_size) {
  bool failed = false;  // a rank exited non-zero: stop the others
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::now();
  size_t running = kids.size();
  auto piped = [](const Child& c) { return c.out_fd >= 0 || c.err_fd >= 0; };
  while (running > 0 || std::any_of(kids.begin(), kids.end(), piped)) {
    wait_for_output(kids);
    for (auto& c : kids) {
      if (!tend(c, world_size)) continue;
      --running;
      if (c.code != 0 && !(g_interrupted && c.code == kStoppedCode)) failed = true;
    }
    if ((failed || g_interrupted) && !stopping) {  // ranks asked to stop finish their step and checkpoint
      stopping = true;
      stop_deadline = std::chrono::steady_clock::now() + (failed ? kGrace : kStopGrace);
      signal_running(kids, SIGTERM);
    }
    if (stopping && failed) stop_deadline = std::min(stop_deadline, std::chrono::steady_clock::now() + kGrace);
    if (stopping && (g_interrupted >= 2 || std::chrono::steady_clock::now() > stop_deadline)) {
      signal_running(kids, SIGKILL);
    }
  }
}

// The launcher's exit code once every rank has exited, after reporting the
// cause of a failure or interruption (and what the flight recorders show).
int report_outcome(const std::vector<Child>& kids, const std::string& error_dir, const std::string& flight_dir) {
  const Cause cause = failure_cause(kids, error_dir, g_interrupted);
  if (cause.rank >= 0 && cause.exit_code == 3 && !error_dir.empty()) {  // a rank's failure, a hang among them
    std::vector<int> ranks;
    std::map<int, int> stopped;  // the frozen ranks: the rings' report names them as the cause
    for (const auto& c : kids) {
      ranks.push_back(c.rank);
      if (c.frozen) stopped[c.rank] = c.stopped;
    }
    report_flights(error_dir, ranks, flight_dir, stopped);
  }
  if (!error_dir.empty()) std::filesystem::remove_all(error_dir);
  const bool all_stopped = std::all_of(kids.begin(), kids.end(), [](const Child& c) { return c.code == kStoppedCode; });
  if (g_interrupted && cause.rank < 0 && all_stopped) {
    std::cerr << "stopped on request: every rank finished its step and the job saved a checkpoint; run the same "
                 "command again to resume\n";
    return kStoppedCode;
  }
  if (g_interrupted && cause.rank < 0) {
    std::cerr << "interrupted; stopped all ranks\n";
    return 130;
  }
  if (cause.rank < 0) return 0;
  std::cerr << cause.message << "\n";
  return cause.exit_code;
}

}  // namespace

bool process_is_stopped(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  const size_t name_end = line.rfind(')');  // the name in parentheses may hold spaces
  if (name_end == std::string::npos || name_end + 2 >= line.size()) return false;
  const char state = line[name_end + 2];
  return state == 'T' || state == 't';
}

bool watch_process(RankProcess& p) {
  if (p.done) return false;
  int status = 0;
  while (waitpid(p.pid, &status, WNOHANG | WUNTRACED | WCONTINUED) == p.pid) {
    if (WIFSTOPPED(status)) {  // frozen while it stays so: its peers will time out waiting for it
      p.stopped = WSTOPSIG(status);
    } else if (WIFCONTINUED(status)) {
      p.stopped = 0;
    } else {
      // Stopped, only SIGKILL ends it: any other end means it ran again.
      const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      p.frozen = killed && p.stopped != 0;
      if (!p.frozen) p.stopped = 0;
      p.done = true;
      p.code = exit_code_of(status);
      if (WIFSIGNALED(status) && WTERMSIG(status) != p.sent) p.signal = WTERMSIG(status);
      return true;
    }
  }
  return false;
}

std::string first_slurm_host(const std::string& list) {
  const size_t cut = list.find_first_of(",[");
  if (cut == std::string::npos || list[cut] == ',') return list.substr(0, cut);
  const size_t end = list.find_first_of("-,]", cut + 1);  // the first number of the first range
  return list.substr(0, cut) + list.substr(cut + 1, (end == std::string::npos ? list.size() : end) - cut - 1);
}

namespace {

// A task of SLURM's srun as one rank (see launcher.h).
std::optional<RankEnv> slurm_rank_env() {
  if (!std::getenv("SLURM_PROCID") || !std::getenv("SLURM_NTASKS")) return std::nullopt;
  RankEnv e;
  e.rank = env_int("SLURM_PROCID", 0);
  e.world_size = env_int("SLURM_NTASKS", 1);
  e.local_rank = env_int("SLURM_LOCALID", 0);
  const int nodes = std::max(1, env_int("SLURM_NNODES", 1));
  e.local_world_size = e.world_size % nodes == 0 ? e.world_size / nodes : e.world_size;
  if (const char* a = std::getenv("MASTER_ADDR")) {
    e.master_addr = a;
  } else if (const char* l = std::getenv("SLURM_STEP_NODELIST") ? std::getenv("SLURM_STEP_NODELIST")
                                                                : std::getenv("SLURM_JOB_NODELIST")) {
    e.master_addr = first_slurm_host(l);
  }
  e.master_port = env_int("MASTER_PORT", 29500);
  if (e.world_size < 1 || e.rank >= e.world_size) {
    throw UserError("SLURM_PROCID " + std::to_string(e.rank) + " is not below SLURM_NTASKS " +
                    std::to_string(e.world_size));
  }
  e.host_store = e.rank == 0;
  e.attempt = env_int("SLURM_RESTART_COUNT", 0);
  return e;
}

}  // namespace

std::optional<RankEnv> rank_env_from_environment() {
  if (!std::getenv("RANK") || !std::getenv("WORLD_SIZE")) return slurm_rank_env();
  RankEnv e;
  e.rank = env_int("RANK", 0);
  e.world_size = env_int("WORLD_SIZE", 1);
  e.local_rank = env_int("LOCAL_RANK", e.rank);
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", e.world_size);
  if (const char* a = std::getenv("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT", 29500);
  if (e.world_size < 1 || e.rank >= e.world_size) {
    throw UserError("RANK " + std::to_string(e.rank) + " is not below WORLD_SIZE " + std::to_string(e.world_size));
  }
  // composer's own launcher hosts the store; under an external one, rank 0 does.
  e.host_store = !std::getenv("COMPOSER_LAUNCHED") && e.rank == 0;
  if (const char* f = std::getenv("COMPOSER_STORE_FILE")) e.store_file = f;
  e.attempt = env_int("COMPOSER_ATTEMPT", env_int("TORCHELASTIC_RESTART_COUNT", 0));
  return e;
}

int launch_local_ranks(int world_size, const NodeOptions& node, const std::vector<std::string>& argv,
                       const RestartOptions& restart, const RankEntry& entry) {
  check_node_options(world_size, node);
  if (restart.max_restarts > 0 && node.nnodes > 1) {
    throw UserError("launch.max_restarts restarts a job that one composer launches; across --nnodes " +
                    std::to_string(node.nnodes) + " nodes let the cluster's launcher restart it (torchrun "
                    "--max-restarts, or a SLURM loop on exit code 3: docs/launching.md#restarts) and set "
                    "launch.max_restarts: 0");
  }
  JobLayout job;
  job.world_size = world_size;
  job.local = world_size / node.nnodes;
  job.node_rank = node.node_rank;
  job.master_addr = node.master_addr;

  // Node 0 hosts the rendezvous store for the whole job, unless the ranks
  // meet through a file store (below); each restart's ranks meet under keys
  // of their own (COMPOSER_ATTEMPT).
  c10::intrusive_ptr<c10d::Store> store;
  job.port = node.master_port;
  const bool file_store = node.nnodes == 1 && node.master_port == 0;
  if (node.node_rank == 0 && !file_store) {
    store = host_rendezvous(node.master_addr, node.master_port, c10d::Store::kDefaultTimeout, &job.port);
  }

  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  for (job.attempt = 0;; ++job.attempt) {
    // Ranks record the time they failed here, so the report names the first,
    // and map their flight recorders here. A single-node job without
    // --master-port also meets here, through a file store: it opens no
    // socket beyond Gloo's on loopback.
    char dir_template[] = "/tmp/composer-errors-XXXXXX";
    job.error_dir = mkdtemp(dir_template) ? dir_template : "";
    job.file_store = file_store && !job.error_dir.empty();
    std::vector<Child> kids = spawn_ranks(job, argv, entry);
    supervise(kids, world_size);
    const int code = report_outcome(kids, job.error_dir, restart.flight_dir);
    // Only a rank's failure (exit 3) is worth a restart: a failed check, bad
    // input, a stop on request or a diverged run would end the same again.
    if (code != 3 || g_interrupted || job.attempt >= restart.max_restarts) {
      if (code == 3 && restart.max_restarts > 0) {
        std::cerr << "launch.max_restarts: the job failed on all " << job.attempt + 1 << " attempts; giving up\n";
      }
      return code;
    }
    std::cerr << "launch.max_restarts: restarting the job (restart " << job.attempt + 1 << " of "
              << restart.max_restarts << ") in " << restart.restart_wait_s << " s; its ranks " << restart.start << "\n"
              << std::flush;
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(static_cast<int64_t>(restart.restart_wait_s * 1000));
    while (std::chrono::steady_clock::now() < until && !g_interrupted) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (g_interrupted) {
      std::cerr << "interrupted before the restart\n";
      return 130;
    }
  }
}

}  // namespace composer

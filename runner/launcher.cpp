#include "runner/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <iostream>
#include <thread>

#include "runner/errors.h"

namespace composer {
namespace {

constexpr auto kGrace = std::chrono::seconds(5);  // SIGTERM to SIGKILL

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) throw UserError(std::string("environment variable ") + name + "='" + v + "' is not a non-negative integer");
  return static_cast<int>(x);
}

struct Child {
  pid_t pid = -1;
  int rank = 0;
  int out_fd = -1, err_fd = -1;
  std::string out_buf, err_buf;
  bool done = false;
  int code = 0;
};

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

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

pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env,
            int out[2], int err[2]) {
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
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv("/proc/self/exe", args.data());
  std::fprintf(stderr, "cannot start rank: %s\n", std::strerror(errno));
  _exit(3);
}

// Whether a TCP port can be listened on (any address), checked before the
// store binds it so that a taken port is one clear error, not library logs.
bool port_is_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return true;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 && listen(fd, 1) == 0;
  close(fd);
  return ok;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

}  // namespace

std::optional<RankEnv> rank_env_from_environment() {
  if (!std::getenv("RANK") || !std::getenv("WORLD_SIZE")) return std::nullopt;
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
  return e;
}

int launch_local_ranks(int world_size, const NodeOptions& node, const std::vector<std::string>& argv) {
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
  const int local = world_size / node.nnodes;

  // Node 0 hosts the rendezvous store for the whole job.
  c10::intrusive_ptr<c10d::TCPStore> store;
  int port = node.master_port;
  if (node.node_rank == 0) {
    if (node.master_port != 0 && !port_is_free(node.master_port)) {
      throw UserError("cannot host the rendezvous on " + node.master_addr + ":" + std::to_string(node.master_port) +
                      ": the port is in use; choose another --master-port");
    }
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(node.master_port);
    o.isServer = true;
    o.waitWorkers = false;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(node.master_addr, o);
    } catch (const std::exception& e) {
      throw UserError("cannot host the rendezvous on " + node.master_addr + ":" + std::to_string(node.master_port) +
                      " (the port is in use or the address is not local); choose another --master-port");
    }
    port = store->getPort();
  }

  // Ranks record the time they failed here, so the report names the first.
  char dir_template[] = "/tmp/composer-errors-XXXXXX";
  const std::string error_dir = mkdtemp(dir_template) ? dir_template : "";

  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  std::vector<Child> kids(local);
  for (int i = 0; i < local; ++i) {
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) throw RuntimeFailure("cannot create pipes for the ranks");
    Child& c = kids[i];
    c.rank = node.node_rank * local + i;
    std::vector<std::pair<std::string, std::string>> env = {
        {"RANK", std::to_string(c.rank)},          {"WORLD_SIZE", std::to_string(world_size)},
        {"LOCAL_RANK", std::to_string(i)},         {"LOCAL_WORLD_SIZE", std::to_string(local)},
        {"MASTER_ADDR", node.master_addr},         {"MASTER_PORT", std::to_string(port)},
        {"COMPOSER_LAUNCHED", "1"},                {"GLOG_minloglevel", "2"},
        {"COMPOSER_ERROR_DIR", error_dir}};
    // OpenBLAS sizes its thread pool when it loads, from the environment: give
    // each rank its share of the cores, or its spinning threads fight the
    // other ranks for them (the trainer sets LibTorch's threads the same way).
    if (!std::getenv("OPENBLAS_NUM_THREADS")) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      env.emplace_back("OPENBLAS_NUM_THREADS", std::to_string(std::max(1, cores / local)));
    }
    c.pid = spawn(argv, env, out, err);
    close(out[1]);
    close(err[1]);
    c.out_fd = out[0];
    c.err_fd = err[0];
    fcntl(c.out_fd, F_SETFL, O_NONBLOCK);
    fcntl(c.err_fd, F_SETFL, O_NONBLOCK);
  }

  int first_code = 0, first_rank = -1;
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::now();
  size_t running = kids.size();
  while (running > 0 || std::any_of(kids.begin(), kids.end(), [](const Child& c) { return c.out_fd >= 0 || c.err_fd >= 0; })) {
    std::vector<pollfd> fds;
    for (auto& c : kids) {
      if (c.out_fd >= 0) fds.push_back({c.out_fd, POLLIN, 0});
      if (c.err_fd >= 0) fds.push_back({c.err_fd, POLLIN, 0});
    }
    if (!fds.empty()) poll(fds.data(), fds.size(), 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (auto& c : kids) {
      const std::string prefix = "[rank " + std::to_string(c.rank) + "/" + std::to_string(world_size) + "] ";
      if (c.out_fd >= 0 && !pump(c.out_fd, c.out_buf, std::cout, prefix)) { close(c.out_fd); c.out_fd = -1; }
      if (c.err_fd >= 0 && !pump(c.err_fd, c.err_buf, std::cerr, prefix)) { close(c.err_fd); c.err_fd = -1; }
      if (c.done) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.done = true;
        c.code = exit_code_of(status);
        --running;
        if (c.code != 0 && first_rank < 0 && !stopping) {
          first_code = c.code;
          first_rank = c.rank;
        }
      }
    }
    if ((first_rank >= 0 || g_interrupted) && !stopping) {
      stopping = true;
      stop_deadline = std::chrono::steady_clock::now() + kGrace;
      for (auto& c : kids) if (!c.done) kill(c.pid, SIGTERM);
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
      for (auto& c : kids) if (!c.done) kill(c.pid, SIGKILL);
    }
  }
  // The rank whose error came first is the cause; the others failed after it.
  int64_t earliest = -1;
  for (const auto& c : kids) {
    std::ifstream in(error_dir + "/" + std::to_string(c.rank));
    int64_t t = 0;
    int code = 0;
    if (in >> t >> code && code != 0 && (earliest < 0 || t < earliest)) {
      earliest = t;
      first_rank = c.rank;
      first_code = code;
    }
  }
  if (!error_dir.empty()) std::filesystem::remove_all(error_dir);
  if (g_interrupted && first_rank < 0) {
    std::cerr << "interrupted; stopped all ranks\n";
    return 130;
  }
  if (first_rank < 0) return 0;
  std::cerr << "rank " << first_rank << " failed with exit code " << first_code
            << (first_code == 1 ? "" : "; stopped the other ranks") << "\n";
  return (first_code == 1 || first_code == 2) ? first_code : 3;
}

}  // namespace composer

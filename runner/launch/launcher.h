// Starting the ranks of a job. Without an external launcher, `composer`
// spawns one process per local rank, hosts the TCPStore rendezvous, prefixes
// each rank's output with [rank r/N], and if any rank fails stops the others
// within seconds and reports the first failure. Under an external launcher
// (torchrun-style RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) the
// process runs as that one rank.
#pragma once
#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace composer {

struct NodeOptions {
  int nnodes = 1;                         // --nnodes: invocations that form the job
  int node_rank = 0;                      // --node-rank: this invocation's index
  std::string master_addr = "127.0.0.1";  // --master-addr: where node 0 hosts the store
  int master_port = 0;                    // --master-port: 0 picks a free port (one node only)
};

// What composer's launcher does when a rank fails.
struct RestartOptions {
  int64_t max_restarts = 0;   // launch.max_restarts: attempts after the first
  double restart_wait_s = 5;  // launch.restart_wait_s
  std::string flight_dir;     // where the ranks' flight records go after a failure ("" = not kept)
  // Where a restarted attempt's ranks begin, as the restart line ends: "its ranks <start>".
  std::string start = "resume from the newest complete checkpoint (from step 1 while none is complete)";
};

// Who this process is when it runs as a rank.
struct RankEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool host_store = false;  // this rank hosts the TCPStore (rank 0 under an external launcher)
  std::string store_file;   // non-empty: meet through this file store (a single-node local launch)
  int attempt = 0;          // 0, then 1, 2, ... for each restart (COMPOSER_ATTEMPT, or torchrun's or SLURM's count)
};

// The rank environment if this process was started as a rank (by composer or
// an external launcher), else nullopt. Bad values are UserErrors.
// Under SLURM's srun (no RANK or WORLD_SIZE, but SLURM_PROCID and
// SLURM_NTASKS), each task is one rank: SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID, the tasks per node from SLURM_NTASKS and SLURM_NNODES, and as
// the rendezvous address MASTER_ADDR or the first host of SLURM_STEP_NODELIST
// (or SLURM_JOB_NODELIST), port MASTER_PORT or 29500.
std::optional<RankEnv> rank_env_from_environment();

// The first host of a SLURM node list: "gpu[03-05,07],cpu1" -> "gpu03".
std::string first_slurm_host(const std::string& nodelist);

// A rank's process as the launcher sees it through waitpid.
struct RankProcess {
  pid_t pid = -1;
  int sent = 0;         // the last signal the launcher sent it (0: none)
  bool done = false;    // it has ended (and was reaped)
  int code = 0;         // its exit code, or 128 + the signal it died of
  int signal = 0;       // the signal it died of, when the launcher did not send it
  int stopped = 0;      // the signal that stopped it (SIGSTOP, SIGTSTP...) while it is stopped, else 0
  bool frozen = false;  // it was still stopped when it died (only SIGKILL ends a stopped process)
};

// Takes every report waitpid has on `p` now, without blocking; returns
// whether it has just ended. A stop followed by a continue and an exit
// between two calls may reach the launcher as the stop, then the exit alone:
// an exit, or a death by any signal but SIGKILL, proves it was running.
bool watch_process(RankProcess& p);

// Whether the process is stopped now (job control or a tracer), as /proc says.
bool process_is_stopped(pid_t pid);

// What a rank forked from the launcher runs in place of composer's main:
// composer with the rank's environment, returning its exit code.
using RankEntry = std::function<int()>;

// Spawns this node's ranks running `argv` and supervises them; returns the
// job's exit code (0, or the first failing rank's 1, 2, 3 or 5). A failure
// that a restart can cure (exit 3: a crash, a killed or frozen rank) starts
// the job again, up to restart.max_restarts times; each rank learns its
// attempt from COMPOSER_ATTEMPT and goes on as restart.start says. With
// `entry`, ranks are forked and run it where the launcher runs one thread
// (spawn in launcher.cpp); without, or where it runs more, they execute `argv`.
int launch_local_ranks(int world_size, const NodeOptions& node, const std::vector<std::string>& argv,
                       const RestartOptions& restart = {}, const RankEntry& entry = {});

}  // namespace composer

// composer: parse the command line, then the stages its command's row asks
// for: load and plan the experiment, check what can be checked before any
// rank starts, then run in this process, start the ranks (a multi-rank mesh
// without an external launcher) or run as one rank. The only place where an
// exception becomes an exit code.
#include <malloc.h>
#include <sys/prctl.h>
#include <time.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include "runner/estimate/estimate.h"
#include "runner/base/memory.h"
#include "runner/cli/cli.h"
#include "runner/cli/commands.h"
#include "runner/launch/flight_report.h"
#include "runner/train/build.h"
#include "runner/base/errors.h"

namespace composer {
namespace {

// Training frees and reallocates the same large buffers every step (gathered
// parameters, full gradients, communication staging). glibc's defaults hand
// them back to the kernel and fault them in again, page by page, each step;
// one arena that keeps freed memory for reuse behaves like a caching
// allocator instead. Peak RSS is what memory reports measure, and reuse keeps
// it down as well.
void tune_allocator() {
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // fixed: no dynamic threshold
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

int report(std::exception_ptr error);
int run(int argc, char** argv);

// A rank forked from composer's launcher: composer's main again, from the
// parsed command line on, in a process whose libraries are loaded already.
int run_forked_rank(const std::vector<std::string>& argv) {
  std::vector<std::string> copy = argv;
  std::vector<char*> args;
  for (auto& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  try {
    return run(static_cast<int>(copy.size()), args.data());
  } catch (...) {
    return report(std::current_exception());
  }
}

// Where the ranks of a restarted attempt begin (Checkpointer::resume_path
// for an attempt after the first), as the launcher's restart line says.
std::string restart_start(const CliOptions& o, const ExperimentConfig& c) {
  const std::string fresh = "start again from step 1";
  if (o.command != Command::kRun) return fresh + " (only composer run resumes from checkpoints)";
  if (!c.checkpoint.enabled) return fresh + " (checkpoint.enabled: false)";
  if (c.checkpoint.resume == "never") return fresh + " (checkpoint.resume: never)";
  return "resume from the newest complete checkpoint (" +
         (c.checkpoint.resume == "auto" ? "from step 1" : "from " + c.checkpoint.resume) + " while none is complete)";
}

// Once per process, before anything else.
void prepare_process() {
  tune_allocator();
  // A write past the file-size limit (RLIMIT_FSIZE) fails with EFBIG, which the
  // writers report, rather than killing the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  install_stop_handlers();  // a rank's; composer's launcher installs its own
}

// The config the command trains: the file with its --set overrides, then the
// command's own change (golden: the single-device twin; a diff side: its side).
ExperimentConfig configured(const CommandSpec& command, const CliOptions& o, const JobPlace& place) {
  ExperimentConfig config = load_config(o.config, o.sets);
  return command.configure ? command.configure(o, config, place) : config;
}

// The ranks of this node: the launcher's count, else the plan's share of this node.
int64_t local_ranks(const CliOptions& o, const Plan& plan, const JobPlace& place) {
  return place.rank ? place.rank->local_world_size : plan.world_size / o.node.nnodes;
}

// What can be refused before any rank starts, each once per job: the devices,
// the files a run opens, whether each rank's memory fits, the plan's warnings.
void check_before_ranks(const CommandSpec& command, const CliOptions& o, const ExperimentConfig& config,
                        const Plan& plan, const JobPlace& place) {
  const int64_t ranks = local_ranks(o, plan, place);
  const bool devices_given = command.devices == Devices::kHereOrGiven && config.mesh.memory_per_rank_mb > 0;
  if (command.devices != Devices::kNone && !devices_given) check_devices(config, ranks);
  if (command.preflight != Preflight::kNothing && place.first()) {
    preflight(config, out_dir_of(o, config),
              command.preflight == Preflight::kFilesAndResume && config.checkpoint.enabled);
    if (command.preflight == Preflight::kFilesAndGolden) read_checked_golden(config);
    if (command.command == Command::kScore) check_score_data(o, config);
  }
  if (command.needs != Needs::kRanks) return;
  if (!place.launched) check_fit(config, estimate_memory(config, plan, ranks), ranks);
  if (place.first()) {
    for (const auto& w : plan.warnings) std::cerr << "warning: " << w << "\n";
  }
}

// Runs the command as the rank the environment names. A rank reports its
// error while its process groups still exist: closing them makes the peers
// fail too, and the launcher must see this rank's report (and stamp) before
// theirs.
int run_as_rank(const CommandSpec& command, const CliOptions& o, const ExperimentConfig& config, const Plan& plan,
                const JobPlace& place) {
  if (place.launched) {
    // "composer r3" in ps and top, for a rank of composer's launcher (before
    // any thread starts: threads take their creator's name).
    const std::string name = "composer r" + std::to_string(place.rank->rank);
    prctl(PR_SET_NAME, name.c_str());
  }
  RankContext rank = join_job(*place.rank, config, plan);
  if (!place.launched) {  // composer's launcher prefixes lines itself
    rank.log_prefix = "[rank " + std::to_string(rank.rank) + "/" + std::to_string(rank.world_size) + "] ";
  }
  try {
    return command.run(o, config, plan, rank);
  } catch (...) {
    const int code = report(std::current_exception());
    // Under an external launcher the rank writes its flight recorder itself
    // (composer's launcher reads the ring the rank mapped).
    if (rank.flight && rank.flight->path().empty()) dump_flight(*rank.flight, out_dir_of(o, config) + "/flight");
    return code;
  }
}

// Runs the command on every rank of the job: here for a one-rank job, in the
// ranks composer's launcher starts, or as the rank an external launcher started.
int run_in_job(const CommandSpec& command, const CliOptions& o, const ExperimentConfig& config, const Plan& plan,
               const JobPlace& place) {
  if (place.rank) return run_as_rank(command, o, config, plan, place);
  if (plan.world_size == 1) {
    RankContext rank = single_rank(config, plan);
    return command.run(o, config, plan, rank);
  }
  RestartOptions restart{config.launch.max_restarts, config.launch.restart_wait_s,
                         out_dir_of(o, config) + "/flight", restart_start(o, config)};
  // Ranks are forked rather than started afresh where nothing the launcher
  // holds would be copied into them: no tensor memory (the ranks count theirs
  // from zero) and no device (CUDA does not survive a fork).
  RankEntry entry;
  if (memory::live_bytes() == 0 && config.mesh.device == DeviceKind::kCpu) entry = [&o] { return run_forked_rank(o.argv); };
  return launch_local_ranks(static_cast<int>(plan.world_size), o.node, o.argv, restart, entry);
}

// The stages. Each command's row (runner/cli/commands.cpp) says which it needs.
int run(int argc, char** argv) {
  prepare_process();
  const CliOptions options = parse_cli(argc, argv);
  if (options.exit_now) return 0;
  const CommandSpec& command = command_spec(options.command);
  RankContext none;  // what a command that joins no job runs as
  if (command.needs == Needs::kOptions) return command.run(options, {}, {}, none);
  const JobPlace place = job_place_from_environment();
  const ExperimentConfig config = configured(command, options, place);
  const Plan plan = make_plan(config, config.mesh.world_size());
  check_before_ranks(command, options, config, plan, place);
  if (command.needs == Needs::kPlan) return command.run(options, config, plan, none);
  return run_in_job(command, options, config, plan, place);
}

// Prints the error and, for a rank started by composer's launcher, records
// when it failed so the launcher can name the rank that failed first.
int fail(int code, const std::string& kind, const std::string& message) {
  std::cerr << kind + ": " + message + "\n";  // one write: the launcher prefixes whole lines
  const char* dir = std::getenv("COMPOSER_ERROR_DIR");
  const char* rank = std::getenv("RANK");
  if (dir && rank) {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    std::ofstream(std::string(dir) + "/" + rank) << ts.tv_sec * 1000000000LL + ts.tv_nsec << " " << code << "\n";
  }
  return code;
}

// Prints the error behind `error` and returns its exit code.
int report(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const UserError& e) {
    return fail(2, "error", e.what());
  } catch (const CheckFailed& e) {
    return fail(1, "check failed", e.what());
  } catch (const Stopped& e) {
    return fail(4, "stopped", e.what());
  } catch (const Diverged& e) {
    return fail(5, "diverged at step " + std::to_string(e.step()), e.what());
  } catch (const RuntimeFailure& e) {
    return fail(3, "runtime failure", e.what());
  } catch (const c10::Error& e) {
    return fail(3, "runtime failure", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(3, "runtime failure", e.what());
  }
}

}  // namespace
}  // namespace composer

int main(int argc, char** argv) {
  composer::memory::install_counting_allocator();  // before any tensor exists
  int code;
  try {
    code = composer::run(argc, argv);
  } catch (...) {
    code = composer::report(std::current_exception());
  }
  composer::exit_flushed(code);
}

// composer: parse the command line, load and plan the experiment, then either
// start the ranks (a multi-rank mesh without an external launcher) or run as
// one rank. The only place where an exception becomes an exit code.
#include <malloc.h>
#include <time.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include "runner/estimate/estimate.h"
#include "runner/base/memory.h"
#include "runner/cli/cli.h"
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

int run(int argc, char** argv) {
  tune_allocator();
  // A write past the file-size limit (RLIMIT_FSIZE) fails with EFBIG, which the
  // writers report, rather than killing the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  install_stop_handlers();  // a rank's; composer's launcher installs its own
  CliOptions options = parse_cli(argc, argv);
  if (options.exit_now) return 0;
  if (options.command == Command::kSuggest) return run_suggest(options);
  ExperimentConfig config = load_config(options.config, options.sets);
  if (options.command == Command::kGolden && (!config.parallelize.empty() || config.mesh.world_size() != 1)) {
    config = single_device_twin(config);
    if (!std::getenv("COMPOSER_LAUNCHED")) {
      std::cout << "golden: training " << config.name << " on one device (parallelize and mesh left out; the golden "
                << "holds for every plan of this config)\n";
    }
  }
  if (options.command == Command::kDiff && !options.record_side.empty()) config = diff_side_config(options, config);
  Plan plan = make_plan(config, config.mesh.world_size());
  if (options.command == Command::kDiff && options.record_side.empty()) return run_diff(options, config);
  std::optional<RankEnv> env = rank_env_from_environment();
  const int64_t local_ranks = env ? env->local_world_size : plan.world_size / options.node.nnodes;
  // `composer plan` of a cuda job needs no GPU here when mesh.memory_per_rank_mb gives the memory of
  // the GPUs it will run on: the plan is checked against that.
  const bool planned_elsewhere = options.command == Command::kPlan && config.mesh.memory_per_rank_mb > 0;
  if (!planned_elsewhere) check_devices(config, local_ranks);
  const bool one_process = options.command == Command::kPlan || options.command == Command::kExport;
  if (options.command != Command::kExport && !std::getenv("COMPOSER_LAUNCHED") && (!env || env->rank == 0)) {
    // once per job, before any rank starts: the files a run opens (check and golden never resume)
    const bool resumes =
        config.checkpoint.enabled && (options.command == Command::kRun || options.command == Command::kPlan);
    preflight(config, out_dir_of(options, config), resumes);
    if (options.command == Command::kCheck) read_checked_golden(config);
  }
  if (!one_process && !std::getenv("COMPOSER_LAUNCHED")) {  // once per job, before any rank starts
    check_fit(config, estimate_memory(config, plan, local_ranks), local_ranks);
  }
  if (!one_process && (!env || env->rank == 0) && !std::getenv("COMPOSER_LAUNCHED")) {
    for (const auto& w : plan.warnings) std::cerr << "warning: " << w << "\n";  // once per job, before it starts
  }
  if (one_process) {  // plan validates and explains, export reads a checkpoint: neither joins a job
    RankContext none;
    return run_command(options, config, plan, none);
  }
  if (!env && plan.world_size == 1) {
    RankContext rank = single_rank(config, plan);
    return run_command(options, config, plan, rank);
  }
  if (!env) {
    RestartOptions restart{config.launch.max_restarts, config.launch.restart_wait_s,
                           out_dir_of(options, config) + "/flight", restart_start(options, config)};
    return launch_local_ranks(static_cast<int>(plan.world_size), options.node, options.argv, restart);
  }
  RankContext rank = join_job(*env, config, plan);
  if (!std::getenv("COMPOSER_LAUNCHED")) {  // composer's launcher prefixes lines itself
    rank.log_prefix = "[rank " + std::to_string(rank.rank) + "/" + std::to_string(rank.world_size) + "] ";
  }
  // A rank reports its error while its process groups still exist: closing
  // them makes the peers fail too, and the launcher must see this rank's
  // report (and stamp) before theirs.
  try {
    return run_command(options, config, plan, rank);
  } catch (...) {
    const int code = report(std::current_exception());
    // Under an external launcher the rank writes its flight recorder itself
    // (composer's launcher reads the ring the rank mapped).
    if (rank.flight && rank.flight->path().empty()) dump_flight(*rank.flight, out_dir_of(options, config) + "/flight");
    return code;
  }
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
  try {
    return composer::run(argc, argv);
  } catch (...) {
    return composer::report(std::current_exception());
  }
}

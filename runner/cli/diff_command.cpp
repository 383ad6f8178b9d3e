// composer diff: the plan and its single-device twin trained to one step, each
// recording it (runner/train/record.h), then compared module by module
// (runner/verify/diff.h). Each side is a job of its own, started as
// `composer diff --record-side single|plan --record-step N` with its output in
// a log beside the records.
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "models/registry.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/replicate.h"
#include "runner/cli/cli.h"
#include "runner/train/record.h"
#include "runner/verify/diff.h"

extern char** environ;

namespace composer {
namespace {

struct SideRun {
  double seconds = 0;
  double max_rss_mb = 0;  // the largest process of the job (a rank)
};

// The last `lines` lines of a file.
std::string tail(const std::string& path, int lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(in, l);) all.push_back(l);
  std::string out;
  for (size_t i = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0; i < all.size(); ++i) {
    out += "  " + all[i] + "\n";
  }
  return out;
}

// The command line of one side's job: this command again, recording `side` at `step` into `dir`.
std::vector<std::string> side_args(const CliOptions& o, const std::string& side, int64_t step, const std::string& dir) {
  std::vector<std::string> args{"/proc/self/exe", "diff", "--config", o.config};
  for (const auto& s : o.sets) {
    args.push_back("--set");
    args.push_back(s);
  }
  for (const auto& m : o.modules) {
    args.push_back("--modules");
    args.push_back(m);
  }
  for (const std::string& a :
       {std::string("--out"), dir, std::string("--record-side"), side, "--record-step=" + std::to_string(step)}) {
    args.push_back(a);
  }
  return args;
}

// Starts `args` with its stdout and stderr in `log`.
pid_t spawn_logged(std::vector<std::string> args, const std::string& log, const std::string& side) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  pid_t pid = 0;
  const int err = posix_spawn(&pid, "/proc/self/exe", &files, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  if (err != 0) throw RuntimeFailure("composer diff: cannot start the " + side + " run: " + std::strerror(err));
  return pid;
}

// Waits for job `pid`, passing a stop request (SIGTERM, SIGINT) on to it;
// its exit code (128 + the signal that ended it).
int wait_passing_stop(pid_t pid, const std::string& side, rusage& usage) {
  int status = 0;
  bool stopping = false;
  for (;;) {
    const pid_t got = wait4(pid, &status, WNOHANG, &usage);
    if (got == pid) break;
    if (got < 0 && errno != EINTR) {
      throw RuntimeFailure("composer diff: lost the " + side + " run: " + std::strerror(errno));
    }
    if (!stopping && stop_requested()) {
      kill(pid, SIGTERM);
      stopping = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (stopping) throw Stopped("composer diff: asked to stop; the " + side + " run was stopped");
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Runs one side to `step` (0: every step, recording none) into `dir`.
SideRun run_side(const CliOptions& o, const std::string& side, int64_t step, const std::string& dir) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string log = dir + ".log";
  const auto t0 = std::chrono::steady_clock::now();
  rusage usage{};
  const int code = wait_passing_stop(spawn_logged(side_args(o, side, step, dir), log, side), side, usage);
  SideRun r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.max_rss_mb = usage.ru_maxrss / 1024.0;
  if (code != 0) {
    const std::string what = "composer diff: the " + std::string(side == "single" ? "single-device" : "plan") +
                             " run failed (exit " + std::to_string(code) + "); the end of " + log + ":\n" +
                             tail(log, 12);
    if (code == 2) throw UserError(what);
    throw RuntimeFailure(what);
  }
  return r;
}

// The first step where the plan parts from one device, training both through
// every step: the first step whose loss or gradient norm composer check finds
// off, or whose update leaves a parameter off (the parameters after each step
// are recorded and compared as diff compares them); 1 when none does.
int64_t first_failing_step(const CliOptions& o, const ExperimentConfig& c, const std::string& dir, bool quiet) {
  if (!quiet) {
    std::cout << "diff: no --step given: training both through " << c.train.steps
              << " steps to find the first step that parts from one device" << std::endl;
  }
  run_side(o, "single", RecordOptions::kEveryStepsParams, dir + "/find/single");
  run_side(o, "plan", RecordOptions::kEveryStepsParams, dir + "/find/plan");
  const Golden g = read_golden(dir + "/find/single/golden.json");
  const Golden mine = read_golden(dir + "/find/plan/golden.json");
  const CompareReport rep = compare(g, c, mine.steps, read_safetensors(dir + "/find/plan/final.safetensors"));
  int64_t step = rep.ok ? 0 : rep.first_failure_step;
  std::string why = step ? "its " + rep.first_failure : "";
  const int64_t last = step ? step - 1 : c.train.steps;  // an update before it may already part
  for (int64_t k = 1; k <= last; ++k) {
    const std::string at = "/record/step" + std::to_string(k);
    const DiffReport params = diff_records(dir + "/find/single" + at, dir + "/find/plan" + at, c.check.param_rtol,
                                           c.check.param_rtol, c.check.param_atol);
    if (const DiffEntry* f = params.first()) {
      step = k;
      why = "its update leaves " + f->name + " off (max abs err " + std::to_string(f->max_abs) + ")";
      break;
    }
  }
  std::error_code ec;  // the per-step parameters served their purpose; the logs and runs stay
  std::filesystem::remove_all(dir + "/find/single/record", ec);
  std::filesystem::remove_all(dir + "/find/plan/record", ec);
  if (!quiet) {
    std::cout << "diff: "
              << (step ? "the first step that parts is " + std::to_string(step) + ": " + why
                       : std::string("the plan matches one device over every step; comparing step 1"))
              << std::endl;
  }
  return step ? step : 1;
}

int64_t bytes_under(const std::string& dir) {
  int64_t n = 0;
  std::error_code ec;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (f.is_regular_file()) n += static_cast<int64_t>(f.file_size());
  }
  return n;
}

// Refuses a config diff cannot compare with one device: no plan, per-rank
// parameters, mixed precision.
void refuse_unlike_one_device(const CliOptions& o, const ExperimentConfig& c) {
  if (c.parallelize.empty() && c.mesh.world_size() == 1) {
    throw UserError(o.config +
                    ": composer diff compares a plan with one device, and this experiment has no plan "
                    "(parallelize is empty); give it a mesh and transforms");
  }
  for (const auto& entry : c.parallelize) {
    const parallel::PerRankFields* f = nullptr;
    if (const auto* fs = std::get_if<FullyShardConfig>(&entry.options)) f = fs;
    if (const auto* rp = std::get_if<ReplicateConfig>(&entry.options)) f = rp;
    if (f && !f->per_rank.empty()) {
      throw UserError(o.config + ": " + entry.name() +
                      ".per_rank gives each data-parallel rank parameters of its own, "
                      "which one device does not have; composer diff compares a plan with one device, so leave "
                      "per_rank out to diff this plan");
    }
  }
  if (!plan_policy(c).empty()) {
    throw UserError(o.config + ": this plan computes with " + plan_policy(c) +
                    " (fully_shard's mixed precision) and "
                    "its single-device twin in " +
                    name_of(c.train.dtype) +
                    ", so every module would differ by "
                    "rounding; diff the plan without param_dtype, reduce_dtype and a rounding all_gather");
  }
}

// Refuses --modules patterns that select no module of the model.
void refuse_unknown_modules(const CliOptions& o, const ExperimentConfig& c) {
  if (o.modules.empty()) return;
  models::ModelPtr model;
  {
    nn::ShapeOnly shapes;
    model = models::find_model(c.model.name)->build(c.model.args);
  }
  for (const auto& [name, m] : nn::named_modules(*model)) {
    if (!name.empty() && records_module({0, "", o.modules}, name)) return;
  }
  throw UserError("--modules selects no module of " + c.model.name +
                  "; give FQN patterns such as 'layers.1' or "
                  "'layers.*.attention' ('*' within a dotted part, '**' across)");
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The plan's pieces cover every tensor one device recorded (replicated ones
// more than once): refuses before filling the disk.
void refuse_short_disk(const std::string& dir, int64_t step) {
  const int64_t single_bytes = bytes_under(dir + "/single/record");
  const auto space = std::filesystem::space(dir);
  if (static_cast<int64_t>(space.available) < single_bytes) {
    throw UserError("composer diff: one device's records of step " + std::to_string(step) + " took " +
                    std::to_string(single_bytes >> 20) + " MiB, and the plan's take at least as much, but " + dir +
                    " has " + std::to_string(space.available >> 20) +
                    " MiB free; record fewer modules with --modules "
                    "(e.g. --modules layers.0) or free space");
  }
}

// Both sides' recordings of one step, and what they cost.
struct Recording {
  int64_t step = 0;
  double find_s = 0;  // finding the step (no --step)
  SideRun one, plan;
};

// Finds the step to record (--step, or the first that parts), then records it on one device and under the plan.
Recording record_both(const CliOptions& o, const ExperimentConfig& c, const std::string& dir, bool quiet) {
  Recording r;
  const auto t0 = std::chrono::steady_clock::now();
  r.step = o.step ? o.step : first_failing_step(o, c, dir, quiet);
  if (r.step > c.train.steps) {
    throw UserError("--step " + std::to_string(r.step) + ": the experiment trains " + std::to_string(c.train.steps) +
                    " steps (train.steps)");
  }
  r.find_s = seconds_since(t0);
  if (!quiet)
    std::cout << "diff: training " << c.name << " on one device to step " << r.step << ", recording it" << std::endl;
  r.one = run_side(o, "single", r.step, dir + "/single");
  refuse_short_disk(dir, r.step);
  if (!quiet) std::cout << "diff: training the plan to step " << r.step << ", recording it" << std::endl;
  r.plan = run_side(o, "plan", r.step, dir + "/plan");
  return r;
}

// report.json: the comparison, the config and what each stage cost.
nlohmann::json report_json(const CliOptions& o, const DiffReport& rep, const Recording& r, double compare_s,
                           const std::string& dir) {
  nlohmann::json j = rep.to_json();
  j["config"] = o.config;
  j["cost"] = {{"find_step_s", r.find_s},
               {"single_s", r.one.seconds},
               {"plan_s", r.plan.seconds},
               {"compare_s", compare_s},
               {"single_max_rss_mb", r.one.max_rss_mb},
               {"plan_max_rss_mb", r.plan.max_rss_mb},
               {"record_bytes", bytes_under(dir + "/single/record") + bytes_under(dir + "/plan/record")}};
  return j;
}

void print_report(const CliOptions& o, const ExperimentConfig& c, const DiffReport& rep, const nlohmann::json& j,
                  const std::string& dir) {
  std::string modules;
  for (const auto& m : o.modules) modules += (modules.empty() ? "" : ", ") + m;
  print_diff(std::cout, rep,
             c.name + " (" + std::to_string(c.mesh.world_size()) + " ranks) against one device" +
                 (modules.empty() ? "" : ", recording only " + modules));
  const auto& cost = j["cost"];
  std::cout.precision(3);
  std::cout << "cost: recording runs " << cost["single_s"].get<double>() << " s (one device) and "
            << cost["plan_s"].get<double>() << " s (plan)"
            << (o.step ? ""
                       : ", finding the step " + std::to_string(cost["find_step_s"].get<double>()).substr(0, 5) + " s")
            << ", comparing " << cost["compare_s"].get<double>() << " s; records "
            << cost["record_bytes"].get<int64_t>() / 1024 << " KiB; report in " << dir << "/report.json\n";
}

}  // namespace

ExperimentConfig diff_side_config(const CliOptions& o, const ExperimentConfig& c) {
  // A non-finite step is what diff must locate, not a reason to stop: it is
  // recorded, its update left out (the config hash ignores both keys).
  ExperimentConfig side = o.record_side == "single" ? single_device_twin(c) : c;
  side.train.on_nonfinite = OnNonFinite::kSkip;
  side.train.max_skipped = std::max<int64_t>(side.train.max_skipped, side.train.steps);
  if (o.record_side == "single") side.debug = DebugConfig{};  // the twin is the reference: no injected fault
  return side;
}

int run_diff(const CliOptions& o, const ExperimentConfig& c) {
  refuse_unlike_one_device(o, c);
  refuse_unknown_modules(o, c);
  if (rank_env_from_environment()) {
    throw UserError(
        "composer diff starts its own local jobs (the plan and one device); run it directly, not under "
        "torchrun or SLURM");
  }
  const std::string dir = out_dir_of(o, c) + "/diff";
  const Recording r = record_both(o, c, dir, /*quiet=*/o.json);
  const auto t1 = std::chrono::steady_clock::now();
  // Activations and gradients are judged against their own scale, with the
  // larger of the check's relative tolerances (its loss and gradient-norm
  // one is a whole-tensor figure too); parameters as the check judges them.
  const double rtol = std::max(c.check.loss_rtol, c.check.param_rtol);
  const DiffReport rep =
      diff_records(dir + "/single/record", dir + "/plan/record", rtol, c.check.param_rtol, c.check.param_atol);
  const double compare_s = seconds_since(t1);
  if (rep.entries.empty()) {
    std::string why;
    for (const auto& n : rep.not_compared) why += "\n  " + n;
    throw RuntimeFailure("composer diff: no tensor of step " + std::to_string(r.step) + " could be compared:" + why);
  }
  const nlohmann::json j = report_json(o, rep, r, compare_s, dir);
  std::ofstream(dir + "/report.json") << j.dump(2) << "\n";
  if (o.json) {
    std::cout << j.dump(2) << "\n";
  } else {
    print_report(o, c, rep, j, dir);
  }
  return rep.first() ? 1 : 0;
}

}  // namespace composer

// The command line: `composer [run|check|golden|plan] --config FILE
// [--set a.b=v ...] [--out DIR]` and `composer export --config FILE
// --checkpoint DIR --out FILE`, and the commands themselves.
#pragma once
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/launch/launcher.h"
#include "runner/plan/planner.h"
#include "runner/launch/rank.h"
#include "runner/verify/golden.h"

namespace composer {

enum class Command { kRun, kCheck, kGolden, kPlan, kExport, kSuggest, kDiff };

struct CliOptions {
  Command command = Command::kRun;
  std::string config;             // --config
  std::vector<std::string> sets;  // --set a.b=value, in order
  std::string out;                // --out; "" = runs/<name> (export: the file)
  std::string checkpoint;         // --checkpoint (export)
  std::string weights;            // --weights (export)
  std::string format;             // --format (export); "" = pt
  std::string max_shard_size;     // --max-shard-size (export); "" = 5GB
  NodeOptions node;               // --nnodes, --node-rank, --master-addr, --master-port
  std::vector<std::string> argv;  // the invocation, to start ranks with
  std::string command_line;       // the whole invocation, for golden headers
  bool json = false;              // --json (plan): one JSON object for tools
  int64_t samples = 0;            // --samples N (plan): where the first N global samples come from
  // suggest: the world searched and the rates it is priced at (0: the defaults, see composer --help)
  int64_t ranks_per_node = 0, nodes = 1, top = 3, max_estimates = 40;
  std::string device_memory;
  double matmul_tflops = 0, intra_gbs = 0, inter_gbs = 0;
  // diff: the step to compare (0: the first step composer check fails, else
  // 1); record_side and record_step: internal, for the runs diff starts
  // (single: the single-device twin; plan: the plan).
  int64_t step = 0;
  std::vector<std::string> modules;  // diff: record only these modules (FQN patterns) and their parameters
  std::string record_side;
  int64_t record_step = 0;
  bool exit_now = false;          // --help or --version was printed
};

// Throws UserError for bad arguments.
CliOptions parse_cli(int argc, char** argv);

// composer suggest: searches, prints the ranking and writes the best plan's
// config (--out, default runs/<name>/suggested.yaml); runs in this process.
int run_suggest(const CliOptions& o);

// composer diff (runner/cli/diff_command.cpp): trains the plan and its
// single-device twin to the step, each recording it, and reports where they
// part; exit 0 on a match, 1 on a divergence. Starts its own jobs.
int run_diff(const CliOptions& o, const ExperimentConfig& c);
// The config a diff run trains: the single-device twin without debug's
// faults, or the plan as given.
ExperimentConfig diff_side_config(const CliOptions& o, const ExperimentConfig& c);

// Runs the command on this rank; returns the exit code (0, or 1 for a failed check).
int run_command(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);

// Where a run's outputs go: --out, or runs/<name>.
std::string out_dir_of(const CliOptions& o, const ExperimentConfig& c);

// check.golden, read and checked against `c` (config hash, dtype, mixed
// precision), with the key's location on failure: `composer check` calls it
// once before any rank starts, and again on each rank.
Golden read_checked_golden(const ExperimentConfig& c);

// The same experiment on one device: no parallelize, no mesh dims. Its golden
// holds for every plan of the config (the hash leaves both out); `composer
// golden` of a plan trains it.
ExperimentConfig single_device_twin(const ExperimentConfig& c);

}  // namespace composer

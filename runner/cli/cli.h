// The command line's options, and the commands themselves (the functions
// runner/cli/commands.cpp's table runs).
#pragma once
#include <set>
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/launch/launcher.h"
#include "runner/plan/planner.h"
#include "runner/launch/rank.h"
#include "runner/verify/golden.h"

namespace composer {

// The verbs; runner/cli/commands.cpp's table says what each needs and runs.
// kDiffSide is one side of a diff (`composer diff --record-side`), started
// by composer diff itself.
enum class Command { kRun, kCheck, kGolden, kPlan, kExport, kScore, kSuggest, kDiff, kDiffSide };

// composer plan's own options.
struct PlanArgs {
  int64_t samples = 0;  // --samples N: where the first N global samples come from
};

// composer export's own options.
struct ExportArgs {
  std::string checkpoint;      // --checkpoint DIR
  std::string weights;         // --weights FILE (score's too)
  std::string format;          // --format; "" = pt
  std::string max_shard_size;  // --max-shard-size; "" = 5GB
  bool merge = false;          // --merge: a train.lora run's adapters added into the base
};

// composer score's own options.
struct ScoreArgs {
  std::string data;        // --data FILE: a token file with FILE.docs (and FILE.mask)
  bool per_token = false;  // --per-token: every target's log-probability too
};

// composer suggest's own options: the world searched and the rates it is
// priced at (0: the defaults, see composer suggest --help).
struct SuggestArgs {
  int64_t ranks_per_node = 0, nodes = 1, top = 3, max_estimates = 1000;
  double max_seconds = 90;  // --max-seconds: the dry runs' time once a plan fits
  std::string device_memory;
  double matmul_tflops = 0, intra_gbs = 0, inter_gbs = 0;
  std::string rates;     // --rates FILE: the machine's figures, as the probe's cache writes them
  bool probe = false;    // --probe: measure this machine again, though cached
  std::string from_run;  // --from-run DIR: compare a finished run with its price and refit the rates
};

struct CliOptions {
  Command command = Command::kRun;
  // every command's
  std::string config;             // --config
  std::vector<std::string> sets;  // --set a.b=value, in order
  std::string out;                // --out; "" = runs/<name> (export: the file)
  NodeOptions node;               // --nnodes, --node-rank, --master-addr, --master-port
  bool json = false;              // --json (plan and diff): one JSON object for tools
  PlanArgs plan;
  ExportArgs exporting;
  ScoreArgs score;
  SuggestArgs suggest;
  // composer diff's own (flat, as runner/cli/diff_command.cpp reads them)
  int64_t step = 0;                  // --step; 0: the first step composer check fails, else 1
  std::vector<std::string> modules;  // --modules: record only these modules (FQN patterns) and their parameters
  // internal, for the runs diff starts: the side (single: the single-device
  // twin; plan: the plan) and the step it records
  std::string record_side;
  int64_t record_step = 0;
  std::set<std::string> given;    // the options on the command line, by long name
  std::vector<std::string> argv;  // the invocation, to start ranks with
  std::string command_line;       // the whole invocation, for golden headers
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

// The commands that run on each rank of a job (`rank`) or in this process (a
// rank of none): composer run, check, golden, one side of a diff, plan and
// export. Each returns the exit code (0, or 1 for a failed check).
int run_train(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);
int run_check(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);
int run_golden(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);
int run_diff_side(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);
int run_plan(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);
int run_export(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);
// composer score (runner/cli/score_command.cpp): on every rank, the
// sequences of --data forward only under the plan; rank 0 writes each one's
// log-probability to --out (default runs/<name>/scores.jsonl).
int run_score(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank);
void check_score_options(const CliOptions& o);
// composer score's --data against the config's model, once before any rank starts: each sequence
// fits a row and holds ids of the vocabulary (UserError otherwise).
void check_score_data(const CliOptions& o, const ExperimentConfig& c);

// Where a run's outputs go: --out, or runs/<name> (composer score: the folder of its --out file).
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

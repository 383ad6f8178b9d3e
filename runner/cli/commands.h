// The commands as a table: each verb's name, help, own options, what main()
// prepares before it runs (a config, a plan, the ranks of a job) and the
// function that runs it. The command line's parser, composer --help and
// composer VERB --help all read this table; main() runs the stages a row asks
// for (tests/docs/cli_help.py keeps the help and the docs in step).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "runner/cli/cli.h"

namespace composer {

// What main() prepares for a command before running it.
enum class Needs {
  kOptions,  // the options alone: the command reads and plans its config itself (suggest)
  kPlan,     // the config and its plan; runs in this process and joins no job (plan, export, diff)
  kRanks,    // the config, its plan and every rank of the job, started here or joined (run, check, golden)
};

// What the first process of a job opens before any rank starts, so that a
// missing file is one message, not one per rank.
enum class Preflight {
  kNothing,
  kFiles,           // the files a run opens (init_from, data, --out); it never resumes
  kFilesAndResume,  // those and the checkpoint checkpoint.resume names
  kFilesAndGolden,  // those and check.golden, read and checked against the config
};

// The devices that must be present before the command runs.
enum class Devices {
  kNone,         // none (composer diff's runs check their own)
  kHere,         // the mesh's devices on this node
  kHereOrGiven,  // those, unless mesh.memory_per_rank_mb describes the devices a plan is made for
};

// Where this process stands in a job: read from the environment once, by main().
struct JobPlace {
  std::optional<RankEnv> rank;  // started as a rank (composer's launcher, torchrun, SLURM), else none
  bool launched = false;        // started by composer's own launcher (COMPOSER_LAUNCHED)
  // The process that acts once per job before any rank starts: the
  // invocation itself, or rank 0 of an external launcher's job.
  bool first() const { return !launched && (!rank || rank->rank == 0); }
};
JobPlace job_place_from_environment();

// A command's function. A kOptions command gets an empty config and plan, and
// one that joins no job a rank of none. Returns the exit code (0, or 1 for a
// failed check or a divergence); every other outcome is an exception.
using CommandFn = int (*)(const CliOptions&, const ExperimentConfig&, const Plan&, RankContext&);
// The config a command trains, from the one given.
using ConfigureFn = ExperimentConfig (*)(const CliOptions&, const ExperimentConfig&, const JobPlace&);
// Checks a command's own option values (the options themselves are checked
// against the table); throws UserError.
using CheckFn = void (*)(const CliOptions&);

struct CommandSpec {
  Command command;
  const char* name;
  const char* about;  // composer --help's paragraph
  Needs needs;
  Preflight preflight;
  Devices devices;
  ConfigureFn configure;  // nullptr: the config as given
  CheckFn check;          // nullptr: no option values of its own to check
  CommandFn run;
  const char* misplaced_hint;  // what follows "--X belongs to composer NAME; " (nullptr: its --help)
  bool hidden;                 // started by composer itself: no help, not a name on the command line
};

// Every command, in the order composer --help lists them.
const std::vector<CommandSpec>& command_table();
const CommandSpec& command_spec(Command c);

// composer --help (no command) or composer VERB --help: generated from the
// command, option and exit-code tables.
std::string help_text(std::optional<Command> c);

}  // namespace composer

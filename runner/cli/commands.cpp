#include "runner/cli/commands.h"

#include <algorithm>
#include <boost/program_options.hpp>
#include <cstdlib>
#include <iostream>
#include <sstream>

namespace po = boost::program_options;

namespace composer {
namespace {

using OptionBinder = po::value_semantic* (*)(CliOptions&);

template <class T>
po::value_semantic* value(T* field) {
  return po::value<T>(field);
}
template <class T>
po::value_semantic* values(std::vector<T>* field) {  // repeatable, in order
  return po::value<std::vector<T>>(field)->composing();
}

struct OptionSpec {
  const char* name;   // the long name, then ",x" for a short one
  const char* value;  // its value as --help shows it; "" for a switch
  const char* help;
  std::vector<Command> owners;  // the commands it belongs to; none: every command
  OptionBinder bind;            // nullptr: --help and --version, which parse_cli answers
  bool required = false;        // its command needs it (shown unbracketed in the usage line)
  bool hidden = false;          // internal: set by composer diff for the runs it starts
};

// The options every command reads: help, the config, the outputs and the
// nodes of a job. A table, one row per option.
std::vector<OptionSpec> common_options() {
  // clang-format off
  return {
      {"help,h", "", "print this help (composer COMMAND --help: that command's)", {}, nullptr},
      {"version", "", "print the version", {}, nullptr},
      {"config,c", "FILE", "experiment YAML file", {}, [](CliOptions& o) { return value(&o.config); }},
      {"set", "PATH=VALUE", "override a config value by its YAML path, e.g. --set train.steps=20 (repeatable)", {},
       [](CliOptions& o) { return values(&o.sets); }},
      {"out", "DIR", "output directory (default runs/<name>); export, score and suggest: the file or folder to write", {},
       [](CliOptions& o) { return value(&o.out); }},
      {"nnodes", "N", "invocations (nodes) that form the job (default 1)", {},
       [](CliOptions& o) { return value(&o.node.nnodes); }},
      {"node-rank", "N", "this node's index, 0 .. nnodes-1 (default 0)", {},
       [](CliOptions& o) { return value(&o.node.node_rank); }},
      {"master-addr", "HOST", "address of node 0 (default 127.0.0.1)", {},
       [](CliOptions& o) { return value(&o.node.master_addr); }},
      {"master-port", "PORT", "rendezvous port on node 0 (default: a free port)", {},
       [](CliOptions& o) { return value(&o.node.master_port); }},
  };
  // clang-format on
}

// The options of some commands only, which the others refuse, naming the
// commands they belong to. A table, one row per option.
std::vector<OptionSpec> command_options() {
  using C = Command;
  // clang-format off
  return {
      {"json", "", "print one JSON object for tools (plan: the resolved config and the plan's figures)",
       {C::kPlan, C::kDiff, C::kSuggest}, [](CliOptions& o) -> po::value_semantic* { return po::bool_switch(&o.json); }},
      {"samples", "N", "where the first N global samples come from (token files: source, window, documents)",
       {C::kPlan}, [](CliOptions& o) { return value(&o.plan.samples); }},
      {"step", "N", "the step to compare (default: the first step composer check fails, else 1)", {C::kDiff},
       [](CliOptions& o) { return value(&o.step); }},
      {"modules", "PATTERN",
       "record only the modules these FQN patterns select, and what they hold (repeatable; default every module)",
       {C::kDiff}, [](CliOptions& o) { return values(&o.modules); }},
      {"record-side", "SIDE", "internal (the runs diff starts)", {C::kDiff},
       [](CliOptions& o) { return value(&o.record_side); }, false, true},
      {"record-step", "N", "internal (the runs diff starts)", {C::kDiff},
       [](CliOptions& o) { return value(&o.record_step); }, false, true},
      {"checkpoint", "DIR", "the checkpoint to export (a step-N folder with index.json)", {C::kExport},
       [](CliOptions& o) { return value(&o.exporting.checkpoint); }},
      {"weights", "FILE",
       "a run's weights file (final.safetensors or init.safetensors, every parameter): export: instead of a "
       "checkpoint; score: in place of the config's initial weights",
       {C::kExport, C::kScore}, [](CliOptions& o) { return value(&o.exporting.weights); }},
      {"format", "pt|hf|peft",
       "pt (one safetensors file, PyTorch names; the default), hf (a Hugging Face folder: Llama, Mixtral, Qwen3) or "
       "peft (a train.lora run's adapter as a PEFT folder)",
       {C::kExport}, [](CliOptions& o) { return value(&o.exporting.format); }},
      {"max-shard-size", "SIZE", "shard above this size (default 5GB; 500MB, 64KiB or bytes)", {C::kExport},
       [](CliOptions& o) { return value(&o.exporting.max_shard_size); }},
      {"merge", "", "pt or hf of a train.lora run: the base with the adapters added into its weights", {C::kExport},
       [](CliOptions& o) -> po::value_semantic* { return po::bool_switch(&o.exporting.merge); }},
      {"data", "FILE", "the token file to score, one sequence per document (FILE.docs; FILE.mask: the targets counted)",
       {C::kScore}, [](CliOptions& o) { return value(&o.score.data); }, true},
      {"per-token", "", "every target's log-probability too, not only each sequence's sum", {C::kScore},
       [](CliOptions& o) -> po::value_semantic* { return po::bool_switch(&o.score.per_token); }},
  };
  // clang-format on
}

// composer suggest's options: the world, the rates, the search's bounds.
std::vector<OptionSpec> suggest_options() {
  using C = Command;
  // clang-format off
  return {
      {"ranks-per-node", "N", "ranks (devices) per node", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.ranks_per_node); }, true},
      {"nodes", "N", "nodes (default 1)", {C::kSuggest}, [](CliOptions& o) { return value(&o.suggest.nodes); }},
      {"device-memory", "SIZE", "memory per rank (80GB, 512MiB)", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.device_memory); }},
      {"matmul-tflops", "X", "a rank's matmul rate, TFLOP/s", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.matmul_tflops); }},
      {"intra-gbs", "X", "a rank's bandwidth within its node, GB/s", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.intra_gbs); }},
      {"inter-gbs", "X", "a rank's bandwidth across nodes, GB/s", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.inter_gbs); }},
      {"rates", "FILE", "the machine's rates as JSON, in the format of the probe's cache (a cluster's, another machine's)",
       {C::kSuggest}, [](CliOptions& o) { return value(&o.suggest.rates); }},
      {"probe", "", "measure this machine's rates again, though cached", {C::kSuggest},
       [](CliOptions& o) -> po::value_semantic* { return po::bool_switch(&o.suggest.probe); }},
      {"from-run", "DIR", "compare a finished run's measured steps with the price of its plan and refit the rates",
       {C::kSuggest}, [](CliOptions& o) { return value(&o.suggest.from_run); }},
      {"top", "N", "plans that must fit before the search stops (default 3)", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.top); }},
      {"max-seconds", "S", "once a plan fits, stop running plans dry after S seconds (default 90)", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.max_seconds); }},
      {"max-estimates", "N", "most plans run dry (default 1000; one over the memory stops where it passes it)", {C::kSuggest},
       [](CliOptions& o) { return value(&o.suggest.max_estimates); }},
  };
  // clang-format on
}

// Every option: the common ones, then each command's.
const std::vector<OptionSpec>& options_table() {
  static const std::vector<OptionSpec> kOptions = [] {
    std::vector<OptionSpec> all = common_options();
    for (auto& o : command_options()) all.push_back(std::move(o));
    for (auto& o : suggest_options()) all.push_back(std::move(o));
    return all;
  }();
  return kOptions;
}

// What each exit code means; main() maps exceptions to them, composer's
// launcher passes on the first failing rank's.
const std::pair<int, const char*> kExitCodes[] = {
    {0, "ok"},
    {1, "check failed: the run does not match its golden, or composer diff found a divergence"},
    {2, "bad input: config, plan, files or options; one message naming the file, line and the fix"},
    {3, "runtime failure, or a rank that failed, was killed or froze: the one code a restart may cure"},
    {4,
     "stopped on request (SIGTERM or SIGINT): the step finished and its checkpoint is saved; the same command "
     "resumes"},
    {5, "diverged: a non-finite loss or gradient under train.on_nonfinite: stop; a restart would repeat it"},
    {130, "stopped at once by a second signal"},
};

std::string long_name(const OptionSpec& opt) {
  const std::string name = opt.name;
  return name.substr(0, name.find(','));
}

bool belongs_to(const OptionSpec& opt, Command c) {
  return opt.owners.empty() || std::find(opt.owners.begin(), opt.owners.end(), c) != opt.owners.end();
}

// "a", "a and b", "a, b and c".
std::string join_and(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == items.size() ? " and " : ", ") + items[i];
  }
  return out;
}

// `items` joined by spaces in lines of at most `width` columns, each after
// `indent` spaces but the first, which continues a line already `indent` wide.
std::string wrapped(const std::vector<std::string>& items, size_t indent, size_t width = 110) {
  std::string out;
  size_t column = indent;
  for (const auto& item : items) {
    if (column > indent && column + 1 + item.size() > width) {
      out += "\n" + std::string(indent, ' ');
      column = indent;
    }
    if (column > indent) {
      out += " ";
      ++column;
    }
    out += item;
    column += item.size();
  }
  return out + "\n";
}

// `text` wrapped at its spaces.
std::string wrapped(const std::string& text, size_t indent) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string word; in >> word;) words.push_back(word);
  return wrapped(words, indent);
}

std::string padded(const std::string& s, size_t width) {
  return s.size() + 2 <= width ? s + std::string(width - s.size(), ' ') : s + "\n" + std::string(width, ' ');
}

std::string option_line(const OptionSpec& opt) {
  const std::string name = opt.name;
  const size_t comma = name.find(',');
  std::string shown =
      comma == std::string::npos ? "    --" + name : "-" + name.substr(comma + 1) + ", --" + long_name(opt);
  if (*opt.value) shown += std::string(" ") + opt.value;
  return "  " + padded(shown, 28) + wrapped(opt.help, 30);
}

// The options of `c` alone (its own), or with `c` empty those of every command.
std::string option_lines(std::optional<Command> c) {
  std::string out;
  for (const auto& opt : options_table()) {
    const bool listed = c ? !opt.owners.empty() && belongs_to(opt, *c) : opt.owners.empty();
    if (listed && !opt.hidden) out += option_line(opt);
  }
  return out;
}

// Wrapped between options, never inside one.
std::string usage_line(const CommandSpec& spec) {
  std::vector<std::string> items{"usage: composer " + std::string(spec.name), "--config FILE", "[--set PATH=VALUE ...]",
                                 "[--out DIR]"};
  for (const auto& opt : options_table()) {
    if (opt.owners.empty() || opt.hidden || !belongs_to(opt, spec.command)) continue;
    std::string shown = "--" + long_name(opt) + (*opt.value ? std::string(" ") + opt.value : "");
    items.push_back(opt.required ? shown : "[" + shown + "]");
  }
  return wrapped(items, 7);
}

std::string exit_code_lines() {
  std::string out = "exit codes:\n";
  for (const auto& [code, meaning] : kExitCodes) out += "  " + padded(std::to_string(code), 6) + wrapped(meaning, 8);
  return out;
}

std::string own_option_names(Command c) {
  std::vector<std::string> names;
  for (const auto& opt : options_table()) {
    if (!opt.owners.empty() && !opt.hidden && belongs_to(opt, c)) names.push_back("--" + long_name(opt));
  }
  return names.empty() ? "" : std::string(11, ' ') + wrapped("its options: " + join_and(names), 11);
}

std::string overview_help() {
  std::string out =
      "usage: composer [COMMAND] --config FILE [--set PATH=VALUE ...] [--out DIR] [OPTION ...]\n"
      "       (COMMAND is run when left out; composer COMMAND --help shows a command's own options)\n\n"
      "commands:\n";
  for (const auto& spec : command_table()) {
    if (!spec.hidden) out += "  " + padded(spec.name, 9) + wrapped(spec.about, 11) + own_option_names(spec.command);
  }
  return out + "\noptions of every command:\n" + option_lines(std::nullopt) + "\n" + exit_code_lines();
}

std::string command_help(const CommandSpec& spec) {
  const std::string own = option_lines(spec.command);
  return usage_line(spec) + "\n" + wrapped(spec.about, 0) + "\n" +
         (own.empty() ? "" : std::string("options of composer ") + spec.name + ":\n" + own + "\n") +
         "options of every command:\n" + option_lines(std::nullopt) + "\n" + exit_code_lines();
}

// The command named on the command line.
Command command_named(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& spec : command_table()) {
    if (spec.hidden) continue;
    if (name == spec.name) return spec.command;
    names.push_back(spec.name);
  }
  std::string list = join_and(names);
  list.replace(list.rfind(" and "), 5, " or ");
  throw UserError("unknown command '" + name + "'; use " + list + " (composer --help)");
}

// An option given to a command it does not belong to: refused, naming the
// commands it belongs to and every option that belongs to just those.
void refuse_misplaced(const CliOptions& o) {
  for (const auto& opt : options_table()) {
    if (!o.given.count(long_name(opt)) || belongs_to(opt, o.command)) continue;
    std::vector<std::string> group, owners;
    for (const auto& other : options_table()) {
      if (other.owners == opt.owners && !other.hidden) group.push_back("--" + long_name(other));
    }
    for (Command c : opt.owners) owners.push_back(command_spec(c).name);
    const CommandSpec& first = command_spec(opt.owners.front());
    throw UserError(join_and(group) + (group.size() == 1 ? " belongs" : " belong") + " to composer " +
                    join_and(owners) + "; " +
                    (first.misplaced_hint ? first.misplaced_hint : "see composer " + owners.front() + " --help"));
  }
}

// A number given on the command line that must be at least 1 (a count, a
// step) or above 0 (a rate): 0 or less would silently mean the default.
void require_given_positive(const CliOptions& o, const char* name, double value, const std::string& what) {
  if (!o.given.count(name) || value > 0) return;
  std::ostringstream shown;
  shown << value;
  throw UserError(std::string("--") + name + " " + shown.str() + ": " + what);
}

void check_plan_options(const CliOptions& o) {
  require_given_positive(o, "samples", static_cast<double>(o.plan.samples), "give a count of samples (at least 1)");
}

void check_diff_options(const CliOptions& o) {
  require_given_positive(o, "step", static_cast<double>(o.step),
                         "give a step of training (1 or more), or leave --step out to compare the first step "
                         "composer check fails");
  const std::string& side = o.record_side;
  if (!side.empty() && side != "single" && side != "plan") {
    throw UserError("--record-side " + side + ": composer diff sets it to single or plan");
  }
}

void check_export_options(const CliOptions& o) {
  const ExportArgs& e = o.exporting;
  if (e.checkpoint.empty() == e.weights.empty() || o.out.empty()) {
    throw UserError(
        "composer export needs one of --checkpoint DIR (a step-N folder) or --weights FILE (a run's "
        "final.safetensors), and --out FILE (a folder with --format hf); see composer export --help");
  }
  if (!e.format.empty() && e.format != "pt" && e.format != "hf" && e.format != "peft") {
    throw UserError("--format " + e.format +
                    ": use pt (a safetensors file), hf (a Hugging Face Llama, Mixtral or Qwen3 folder) or peft (the "
                    "LoRA adapter of a train.lora run, as a PEFT folder)");
  }
}

void check_suggest_options(const CliOptions& o) {
  const SuggestArgs& s = o.suggest;
  if (!s.from_run.empty()) {
    if (o.given.count("ranks-per-node") || o.given.count("nodes")) {
      throw UserError("--from-run DIR prices the run's own plan on its own ranks; leave out --ranks-per-node and --nodes");
    }
    return;
  }
  require_given_positive(o, "ranks-per-node", static_cast<double>(s.ranks_per_node),
                         "give the ranks (devices) of one node (1 or more)");
  if (s.ranks_per_node < 1) {
    throw UserError(
        "composer suggest needs --ranks-per-node N (the ranks, or devices, of one node); see composer "
        "suggest --help");
  }
  require_given_positive(o, "nodes", static_cast<double>(s.nodes), "give the nodes of the world (1 or more)");
  require_given_positive(o, "top", static_cast<double>(s.top),
                         "give the plans that must fit before the search stops (1 or more, default 3)");
  require_given_positive(o, "max-seconds", s.max_seconds, "give the seconds the dry runs may take once a plan fits");
  require_given_positive(o, "max-estimates", static_cast<double>(s.max_estimates),
                         "give the most plans to run dry (1 or more, default 40)");
  const char* rate = "must be above 0; leave it out for the default (composer suggest --help)";
  require_given_positive(o, "matmul-tflops", s.matmul_tflops, std::string("a matmul rate ") + rate);
  require_given_positive(o, "intra-gbs", s.intra_gbs, std::string("a bandwidth ") + rate);
  require_given_positive(o, "inter-gbs", s.inter_gbs, std::string("a bandwidth ") + rate);
}

// composer golden of a plan trains its single-device twin, whose golden holds
// for every plan of the config.
ExperimentConfig golden_config(const CliOptions&, const ExperimentConfig& c, const JobPlace& place) {
  if (c.parallelize.empty() && c.mesh.world_size() == 1) return c;
  ExperimentConfig twin = single_device_twin(c);
  if (!place.launched) {
    std::cout << "golden: training " << twin.name << " on one device (parallelize and mesh left out; the golden "
              << "holds for every plan of this config)\n";
  }
  return twin;
}

}  // namespace

const std::vector<CommandSpec>& command_table() {
  using C = Command;
  // A table, one row per command.
  // clang-format off
  static const std::vector<CommandSpec> kCommands = {
      {C::kRun, "run",
       "train the experiment (the default command); starts one process per rank of the mesh; outputs in "
       "runs/<name> or --out",
       Needs::kRanks, Preflight::kFilesAndResume, Devices::kHere, nullptr, nullptr, run_train, nullptr, false},
      {C::kCheck, "check", "train from the golden file's initial weights (check.golden) and compare with it; exit 1 on a mismatch",
       Needs::kRanks, Preflight::kFilesAndGolden, Devices::kHere, nullptr, nullptr, run_check, nullptr, false},
      {C::kGolden, "golden",
       "train on one device (a plan's config: the same experiment without parallelize and mesh) and write the "
       "golden file (check.golden), with the initial weights beside it when the config draws them",
       Needs::kRanks, Preflight::kFiles, Devices::kHere, golden_config, nullptr, run_golden, nullptr, false},
      {C::kPlan, "plan",
       "validate the config and summarise the plan: placements, memory and communication per rank (--json: the "
       "resolved config and every figure, for tools); opens what a run would open",
       Needs::kPlan, Preflight::kFilesAndResume, Devices::kHereOrGiven, nullptr, check_plan_options, run_plan,
       nullptr, false},
      {C::kDiff, "diff",
       "train the plan and the same experiment on one device to step N (default: the first step check fails, else "
       "1), recording every module's output and input gradient and every parameter's gradient, and name the first "
       "module, microbatch and direction where they part; exit 1 on a divergence",
       Needs::kPlan, Preflight::kNothing, Devices::kNone, nullptr, check_diff_options,
       [](const CliOptions& o, const ExperimentConfig& c, const Plan&, RankContext&) { return run_diff(o, c); },
       nullptr, false},
      {C::kExport, "export",
       "write a checkpoint's (--checkpoint DIR) or a weights file's (--weights FILE) weights to --out as one "
       "safetensors file for PyTorch (in shards with an index above --max-shard-size), or with --format hf a "
       "Hugging Face Llama, Mixtral, Qwen3 or DeepSeek-V3 folder (config.json and model.safetensors) that "
       "transformers loads, or with --format peft a train.lora run's adapters as a PEFT folder (--merge: pt or hf "
       "with them added into the base); runs in this process",
       Needs::kPlan, Preflight::kNothing, Devices::kHere, nullptr, check_export_options, run_export,
       "to resume a run, set checkpoint.resume (--set checkpoint.resume=DIR)", false},
      {C::kScore, "score",
       "write the log-probability the model (its from_hf, init_from or lora_from weights) gives each sequence of "
       "--data, forward only under the config's plan: one JSON line per sequence to --out (default "
       "runs/<name>/scores.jsonl) with its summed log-probability of the targets the loss mask counts and their "
       "count (--per-token: every target's too); each sequence is one row of data.seq_len + 1 tokens at most",
       Needs::kRanks, Preflight::kFiles, Devices::kHere, nullptr, check_score_options, run_score, nullptr, false},
      {C::kSuggest, "suggest",
       "search the plans of the config's model for a world of ranks (its own mesh and parallelize ignored), price "
       "them by a cost model, run the cheapest dry until --top fit --device-memory, and write the best as a config "
       "that says why it wins (default runs/<name>/suggested.yaml). Rates: on cpu probed here (the node's ranks at "
       "once, cached in ~/.cache/composer/machine.json), on cuda an H100-class GPU's, or --rates FILE; --from-run DIR "
       "compares a finished run with its price and refits them; memory: mesh.memory_per_rank_mb, else the host's "
       "(cuda: required)",
       Needs::kOptions, Preflight::kNothing, Devices::kNone, nullptr, check_suggest_options,
       [](const CliOptions& o, const ExperimentConfig&, const Plan&, RankContext&) { return run_suggest(o); },
       nullptr, false},
      {C::kDiffSide, "diff", "one side of composer diff: train to the step, recording it", Needs::kRanks,
       Preflight::kFiles, Devices::kHere, [](const CliOptions& o, const ExperimentConfig& c, const JobPlace&) {
         return diff_side_config(o, c);
       },
       nullptr, run_diff_side, nullptr, true},
  };
  // clang-format on
  return kCommands;
}

const CommandSpec& command_spec(Command c) {
  for (const auto& spec : command_table()) {
    if (spec.command == c) return spec;
  }
  throw std::logic_error("a command without a row in the command table");
}

std::string help_text(std::optional<Command> c) { return c ? command_help(command_spec(*c)) : overview_help(); }

JobPlace job_place_from_environment() {
  return JobPlace{rank_env_from_environment(), std::getenv("COMPOSER_LAUNCHED") != nullptr};
}

namespace {

// Declares every option to boost, each writing into `o`.
po::options_description declared_options(CliOptions& o) {
  po::options_description desc;
  for (const auto& opt : options_table()) {
    if (opt.bind) {
      desc.add_options()(opt.name, opt.bind(o), opt.help);
    } else {
      desc.add_options()(opt.name, opt.help);
    }
  }
  desc.add_options()("command", po::value<std::string>(), "the command");
  return desc;
}

// Parses argv into `o` and returns what it found (o.given: the options given).
po::variables_map parsed(int argc, char** argv, CliOptions& o) {
  const po::options_description desc = declared_options(o);
  po::positional_options_description pos;
  pos.add("command", 1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw UserError(std::string(e.what()) + "; see composer --help");
  }
  for (const auto& opt : options_table()) {
    const std::string name = long_name(opt);
    if (vm.count(name) && !vm[name].defaulted()) o.given.insert(name);
  }
  return vm;
}

}  // namespace

CliOptions parse_cli(int argc, char** argv) {
  CliOptions o;
  for (int i = 0; i < argc; ++i) {
    o.command_line += (i ? " " : "") + std::string(argv[i]);
    o.argv.push_back(argv[i]);
  }
  const po::variables_map vm = parsed(argc, argv, o);
  std::optional<Command> named;
  if (vm.count("command")) named = command_named(vm["command"].as<std::string>());
  if (o.given.count("help")) {
    std::cout << help_text(named);
    o.exit_now = true;
    return o;
  }
  if (o.given.count("version")) {
    std::cout << "composer " << COMPOSER_VERSION << " (libtorch " << TORCH_VERSION << ")\n";
    o.exit_now = true;
    return o;
  }
  o.command = named.value_or(Command::kRun);
  if (o.config.empty()) throw UserError("missing --config FILE; see composer --help");
  refuse_misplaced(o);
  const CommandSpec& spec = command_spec(o.command);
  if (spec.check) spec.check(o);
  // the runs composer diff starts: one side each
  if (o.command == Command::kDiff && !o.record_side.empty()) o.command = Command::kDiffSide;
  return o;
}

}  // namespace composer

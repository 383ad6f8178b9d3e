#include "runner/estimate/estimate.h"
#include "runner/cli/cli.h"

#include <boost/program_options.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <tuple>

#include "runner/checkpoint/export.h"
#include "runner/verify/golden.h"
#include "runner/cli/plan_report.h"
#include "runner/suggest/suggest.h"
#include "runner/train/build.h"
#include "runner/train/trainer.h"

namespace po = boost::program_options;

namespace composer {
namespace {

const char kUsage[] =
    "usage: composer [run|check|golden|plan] --config FILE [--set PATH=VALUE ...] [--out DIR] [--json]\n"
    "       composer diff --config FILE [--step N] [--set PATH=VALUE ...] [--out DIR] [--json]\n"
    "       composer suggest --config FILE --ranks-per-node N [--nodes N] [--device-memory 80GB]\n"
    "                        [--matmul-tflops X] [--intra-gbs X] [--inter-gbs X] [--top N] [--out FILE]\n"
    "       composer export --config FILE (--checkpoint DIR | --weights FILE) --out PATH [--format pt|hf]\n"
    "                       [--max-shard-size 5GB]\n"
    "\n"
    "commands:\n"
    "  run     train the experiment (default)\n"
    "  check   train and compare with the golden file; exit 1 on mismatch\n"
    "  golden  train on one device (a plan's config: the same experiment without parallelize and\n"
    "          mesh) and write the golden file (check.golden)\n"
    "  diff    train the plan and the same experiment on one device to step N (default: the first step\n"
    "          check fails, else 1), recording every module's output and input gradient and every\n"
    "          parameter's gradient, and name the first module, microbatch and direction where they part;\n"
    "          exit 1 on a divergence\n"
    "  plan    validate the config and summarise the plan: placements, memory and communication\n"
    "          per rank (--json: the resolved config and every figure, for tools)\n"
    "  export  write a checkpoint's or a weights file's weights as one safetensors file for PyTorch (in\n"
    "          shards with an index above --max-shard-size), or with --format hf a Hugging Face Llama\n"
    "          folder (config.json and model.safetensors) that transformers loads; runs in this process\n"
    "  suggest search the plans of the config's model for a world of ranks (its own mesh and parallelize\n"
    "          ignored), rank them by a cost model, run the cheapest dry until --top fit --device-memory,\n"
    "          and write the best as a config (default runs/<name>/suggested.yaml). Defaults: on cpu the\n"
    "          matmul rate measured here at each plan's matmul shape, shared by the node's ranks, 2 and\n"
    "          1 GB/s; on cuda 400 TFLOP/s, 200 and 25 GB/s; memory: mesh.memory_per_rank_mb, else the\n"
    "          host's (cuda: required)\n"
    "\n"
    "exit codes: 0 ok, 1 check failed, 2 bad input, 3 runtime failure, 4 stopped on request, 5 diverged (a\n"
    "            loss or gradient not finite)\n";

const std::pair<const char*, Command> kCommands[] = {
    {"run", Command::kRun}, {"check", Command::kCheck}, {"golden", Command::kGolden}, {"plan", Command::kPlan},
    {"export", Command::kExport}, {"suggest", Command::kSuggest}, {"diff", Command::kDiff}};

std::string prepare_out_dir(const CliOptions& o, const ExperimentConfig& c) {
  std::string dir = out_dir_of(o, c);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UserError("--out " + dir + ": cannot create the output directory: " + ec.message());
  return dir;
}

void print_train_summary(const TrainResult& r, const std::string& dir) {
  if (r.steps.empty()) return;
  std::cout << "loss " << r.steps.front().loss << " -> " << r.steps.back().loss << " over " << r.steps.size()
            << " steps; outputs in " << dir << "\n";
}

}  // namespace

Golden read_checked_golden(const ExperimentConfig& c) {
  Golden g = naming_config_key(c.check.golden_ref, [&] { return read_golden(golden_path(c)); });
  check_golden_header(g, c);
  return g;
}

ExperimentConfig single_device_twin(const ExperimentConfig& c) {
  ExperimentConfig twin = c;
  twin.parallelize.clear();
  twin.mesh.shape.clear();
  twin.mesh.names.clear();
  return twin;
}

namespace {

// The composer diff command for the same config and overrides.
std::string diff_command(const CliOptions& o) {
  auto quoted = [](const std::string& a) {  // as a shell reads it back
    if (a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.,/=:+@") ==
        std::string::npos) {
      return a;
    }
    std::string q = "'";
    for (char ch : a) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return q + "'";
  };
  std::string cmd = "composer diff --config " + quoted(o.config);
  for (const auto& s : o.sets) cmd += " --set " + quoted(s);
  return cmd;
}

int do_check(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank) {
  // Fail before training when it is missing or made for another experiment.
  Golden g = read_checked_golden(c);
  std::string dir = prepare_out_dir(o, c);
  TrainResult r = train(c, p, rank, dir);
  if (!rank.is_main()) return 0;
  CompareReport rep = compare(g, c, r.steps, read_safetensors(dir + "/final.safetensors"));
  std::cout.precision(3);
  std::cout << rank.log_prefix << "check " << c.name << " against " << golden_path(c) << " ("
            << g.header["generator"].get<std::string>() << "): max loss rel err " << rep.max_loss_rel_err
            << ", max param abs err " << rep.max_param_abs_err << " (" << rep.worst_param << "), max param rel err "
            << rep.max_param_rel_err << ", max grad_norm rel err " << rep.max_grad_norm_rel_err;
  if (rep.eval_losses > 0) std::cout << ", " << rep.eval_losses << " eval losses, max rel err " << rep.max_eval_rel_err;
  std::cout << "; worst error at " << 100 * rep.max_tolerance_used << "% of its tolerance\n";
  if (!rep.ok) {
    throw CheckFailed("check failed with " + std::to_string(rep.failures) + " mismatch(es) (" +
                      std::to_string(rep.step_failures) + " in per-step losses and gradient norms, " +
                      std::to_string(rep.param_failures) +
                      " in final parameters); first divergence: " + rep.first_failure +
                      ". To see which module, microbatch and direction part first: " + diff_command(o));
  }
  std::cout << rank.log_prefix << "check passed\n";
  return 0;
}

}  // namespace

namespace {

// Every option, each writing into `o`.
void add_cli_options(po::options_description& desc, CliOptions& o) {
  desc.add_options()("help,h", "print this help")("version", "print the version")(
      "config,c", po::value<std::string>(&o.config), "experiment YAML file")(
      "set", po::value<std::vector<std::string>>(&o.sets)->composing(),
      "override a config value by its YAML path, e.g. --set train.steps=20 (repeatable)")(
      "out", po::value<std::string>(&o.out), "output directory (default runs/<name>); export: the file to write")(
      "checkpoint", po::value<std::string>(&o.checkpoint), "export: the checkpoint (a step-N folder with index.json)")(
      "weights", po::value<std::string>(&o.weights),
      "export: a weights file instead of a checkpoint (a run's final.safetensors or init.safetensors)")(
      "format", po::value<std::string>(&o.format),
      "export: pt (one safetensors file, PyTorch names; the default) or hf (a Hugging Face folder: Llama, Mixtral)")(
      "max-shard-size", po::value<std::string>(&o.max_shard_size),
      "export: shard above this size (default 5GB; 500MB, 64KiB or bytes)")(
      "nnodes", po::value<int>(&o.node.nnodes), "invocations (nodes) that form the job (default 1)")(
      "node-rank", po::value<int>(&o.node.node_rank), "this node's index, 0 .. nnodes-1 (default 0)")(
      "master-addr", po::value<std::string>(&o.node.master_addr), "address of node 0 (default 127.0.0.1)")(
      "master-port", po::value<int>(&o.node.master_port), "rendezvous port on node 0 (default: a free port)")(
      "json", po::bool_switch(&o.json), "plan: print the resolved config and the plan's figures as one JSON object")(
      "samples", po::value<int64_t>(&o.samples),
      "plan: where the first N global samples come from (token files: source, window, documents)")(
      "ranks-per-node", po::value<int64_t>(&o.ranks_per_node), "suggest: ranks (devices) per node")(
      "nodes", po::value<int64_t>(&o.nodes), "suggest: nodes (default 1)")(
      "device-memory", po::value<std::string>(&o.device_memory), "suggest: memory per rank (80GB, 512MiB)")(
      "matmul-tflops", po::value<double>(&o.matmul_tflops), "suggest: a rank's matmul rate, TFLOP/s")(
      "intra-gbs", po::value<double>(&o.intra_gbs), "suggest: a rank's bandwidth within its node, GB/s")(
      "inter-gbs", po::value<double>(&o.inter_gbs), "suggest: a rank's bandwidth across nodes, GB/s")(
      "top", po::value<int64_t>(&o.top), "suggest: plans that must fit before the search stops (default 3)")(
      "max-estimates", po::value<int64_t>(&o.max_estimates), "suggest: most plans run dry (default 40)")(
      "step", po::value<int64_t>(&o.step), "diff: the step to compare (default: the first step check fails, else 1)")(
      "modules", po::value<std::vector<std::string>>(&o.modules)->composing(),
      "diff: record only the modules these FQN patterns select, and what they hold (repeatable; default every module)")(
      "record-side", po::value<std::string>(&o.record_side), "diff: internal (the runs diff starts)")(
      "record-step", po::value<int64_t>(&o.record_step), "diff: internal (the runs diff starts)")(
      "command", po::value<std::string>(), "run, check, golden, plan, diff, export or suggest");
}

// The command named by the positional argument.
Command command_named(const std::string& name) {
  for (const auto& [n, cmd] : kCommands) {
    if (name == n) return cmd;
  }
  throw UserError("unknown command '" + name + "'; use run, check, golden, plan, diff, export or suggest (composer --help)");
}

// A number given on the command line that must be at least 1 (a count, a
// step) or above 0 (a rate): 0 or less would silently mean the default.
void require_given_positive(const po::variables_map& vm, const char* name, double value, const std::string& what) {
  if (!vm.count(name) || value > 0) return;
  std::ostringstream shown;
  shown << value;
  throw UserError(std::string("--") + name + " " + shown.str() + ": " + what);
}

// Options that belong together, or to one command only.
void check_combinations(const CliOptions& o, const po::variables_map& vm) {
  if (o.config.empty()) throw UserError("missing --config FILE; see composer --help");
  const bool exporting = o.command == Command::kExport;
  if (exporting && (o.checkpoint.empty() == o.weights.empty() || o.out.empty())) {
    throw UserError("composer export needs one of --checkpoint DIR (a step-N folder) or --weights FILE (a run's "
                    "final.safetensors), and --out FILE (a folder with --format hf); see composer --help");
  }
  if (exporting && !o.format.empty() && o.format != "pt" && o.format != "hf") {
    throw UserError("--format " + o.format +
                    ": use pt (a safetensors file) or hf (a Hugging Face Llama or Mixtral folder)");
  }
  const bool diffing = o.command == Command::kDiff;
  if (o.json && o.command != Command::kPlan && !diffing) {
    throw UserError("--json belongs to composer plan and diff; see composer --help");
  }
  if ((vm.count("step") || !o.modules.empty() || !o.record_side.empty() || vm.count("record-step")) && !diffing) {
    throw UserError("--step and --modules belong to composer diff; see composer --help");
  }
  require_given_positive(vm, "step", static_cast<double>(o.step),
                         "give a step of training (1 or more), or leave --step out to compare the first step "
                         "composer check fails");
  if (!o.record_side.empty() && o.record_side != "single" && o.record_side != "plan") {
    throw UserError("--record-side " + o.record_side + ": composer diff sets it to single or plan");
  }
  if (vm.count("samples") && o.command != Command::kPlan) {
    throw UserError("--samples belongs to composer plan; see composer --help");
  }
  require_given_positive(vm, "samples", static_cast<double>(o.samples), "give a count of samples (at least 1)");
  const bool suggesting = o.command == Command::kSuggest;
  if (suggesting) {
    require_given_positive(vm, "ranks-per-node", static_cast<double>(o.ranks_per_node),
                           "give the ranks (devices) of one node (1 or more)");
  }
  if (suggesting && o.ranks_per_node < 1) {
    throw UserError("composer suggest needs --ranks-per-node N (the ranks, or devices, of one node); see composer --help");
  }
  if (suggesting) {
    require_given_positive(vm, "nodes", static_cast<double>(o.nodes), "give the nodes of the world (1 or more)");
    require_given_positive(vm, "top", static_cast<double>(o.top),
                           "give the plans that must fit before the search stops (1 or more, default 3)");
    require_given_positive(vm, "max-estimates", static_cast<double>(o.max_estimates),
                           "give the most plans to run dry (1 or more, default 40)");
    const char* rate = "must be above 0; leave it out for the default (composer --help)";
    require_given_positive(vm, "matmul-tflops", o.matmul_tflops, std::string("a matmul rate ") + rate);
    require_given_positive(vm, "intra-gbs", o.intra_gbs, std::string("a bandwidth ") + rate);
    require_given_positive(vm, "inter-gbs", o.inter_gbs, std::string("a bandwidth ") + rate);
  }
  if (!suggesting &&
      (vm.count("ranks-per-node") || vm.count("nodes") || vm.count("device-memory") || vm.count("matmul-tflops") ||
       vm.count("intra-gbs") || vm.count("inter-gbs") || vm.count("top") || vm.count("max-estimates"))) {
    throw UserError("--ranks-per-node, --nodes, --device-memory, --matmul-tflops, --intra-gbs, --inter-gbs, --top and "
                    "--max-estimates belong to composer suggest; see composer --help");
  }
  if (!exporting && (!o.checkpoint.empty() || !o.max_shard_size.empty() || !o.weights.empty() || !o.format.empty())) {
    throw UserError("--checkpoint, --weights, --format and --max-shard-size belong to composer export; to resume a "
                    "run, set checkpoint.resume (--set checkpoint.resume=DIR)");
  }
}

}  // namespace

CliOptions parse_cli(int argc, char** argv) {
  CliOptions o;
  for (int i = 0; i < argc; ++i) {
    o.command_line += (i ? " " : "") + std::string(argv[i]);
    o.argv.push_back(argv[i]);
  }
  po::options_description desc("options");
  add_cli_options(desc, o);
  po::positional_options_description pos;
  pos.add("command", 1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw UserError(std::string(e.what()) + "; see composer --help");
  }
  if (vm.count("help")) {
    std::cout << kUsage << "\n" << desc;
    o.exit_now = true;
    return o;
  }
  if (vm.count("version")) {
    std::cout << "composer " << COMPOSER_VERSION << " (libtorch " << TORCH_VERSION << ")\n";
    o.exit_now = true;
    return o;
  }
  if (vm.count("command")) o.command = command_named(vm["command"].as<std::string>());
  check_combinations(o, vm);
  return o;
}

int run_command(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank) {
  switch (o.command) {
    case Command::kPlan:
      if (o.json) {
        nlohmann::json j = plan_json(c, p);
        if (o.samples > 0) j["samples"] = preview_samples(c, o.samples);
        std::cout << j.dump(2) << "\n";
      } else {
        print_plan(std::cout, c, p);
        if (o.samples > 0) print_samples(std::cout, preview_samples(c, o.samples));
      }
      return 0;
    case Command::kRun: {
      std::string dir = prepare_out_dir(o, c);
      TrainResult r = train(c, p, rank, dir, /*checkpoints=*/c.checkpoint.enabled);
      if (rank.is_main()) print_train_summary(r, dir);
      return 0;
    }
    case Command::kGolden: {
      TORCH_INTERNAL_ASSERT(c.parallelize.empty() && p.world_size == 1, "composer golden runs the single-device twin");
      std::string dir = prepare_out_dir(o, c);
      TrainResult r = train(c, p, rank, dir);
      if (auto why = degenerate_steps(r.steps)) {
        throw UserError("refusing to write the golden " + golden_path(c) + ": " + *why +
                        "; change the seed, learning rate or loss so every step trains");
      }
      write_golden(golden_path(c), make_golden(c, r.steps, read_safetensors(dir + "/final.safetensors"), o.command_line));
      std::cout << "wrote " << golden_path(c) << "\n";
      return 0;
    }
    case Command::kCheck: return do_check(o, c, p, rank);
    case Command::kDiff: {  // one side of a diff: train to the step, recording it
      std::string dir = prepare_out_dir(o, c);
      TrainResult r =
          train(c, p, rank, dir, /*checkpoints=*/false, RecordOptions{o.record_step, dir + "/record", o.modules});
      if (rank.is_main()) {
        write_golden(dir + "/golden.json",
                     make_golden(c, r.steps, read_safetensors(dir + "/final.safetensors"), o.command_line));
      }
      return 0;
    }
    case Command::kSuggest: return run_suggest(o);
    case Command::kExport: {
      ExportOptions e;
      e.checkpoint = o.checkpoint;
      e.weights = o.weights;
      e.out = o.out;
      e.format = o.format == "hf" ? ExportFormat::kHf : ExportFormat::kPt;
      if (!o.max_shard_size.empty()) e.max_shard_bytes = parse_byte_size(o.max_shard_size, "--max-shard-size");
      for (const auto& line : export_weights(c, e)) std::cout << line << "\n";
      return 0;
    }
  }
  return 0;
}

int run_suggest(const CliOptions& o) {
  check_suggest_overrides(o.sets);
  const ExperimentConfig given = load_config(o.config, o.sets);  // its errors point at the file
  World w;
  w.ranks_per_node = o.ranks_per_node;
  w.nodes = o.nodes;
  const bool cuda = given.mesh.device == DeviceKind::kCuda;
  if (!o.device_memory.empty()) {
    w.memory_per_rank = static_cast<int64_t>(parse_byte_size(o.device_memory, "--device-memory"));
  } else if (given.mesh.memory_per_rank_mb > 0 || !cuda) {
    w.memory_per_rank = memory_per_rank(given, w.ranks_per_node);
  } else {
    throw UserError("composer suggest of a cuda config needs --device-memory (e.g. 80GB) or mesh.memory_per_rank_mb");
  }
  w.matmul_flops = o.matmul_tflops > 0 ? o.matmul_tflops * 1e12 : 400e12;
  if (o.matmul_tflops <= 0 && !cuda) {  // here: measured at each plan's shape, the cores shared by a node's ranks
    auto cache = std::make_shared<std::map<std::tuple<int64_t, int64_t, int64_t>, double>>();
    w.matmul_rate = [cache, ranks = w.ranks_per_node](int64_t rows, int64_t k, int64_t n) {
      auto [it, fresh] = cache->emplace(std::make_tuple(rows, k, n), 0.0);
      if (fresh) it->second = measure_matmul_flops(rows, k, n, 0.2) / static_cast<double>(ranks);
      return it->second;
    };
  }
  w.intra_bytes_per_s = (o.intra_gbs > 0 ? o.intra_gbs : cuda ? 200 : 2) * 1e9;
  w.inter_bytes_per_s = (o.inter_gbs > 0 ? o.inter_gbs : cuda ? 25 : 1) * 1e9;
  const auto t0 = std::chrono::steady_clock::now();
  Suggestion s = suggest(o.config, o.sets, w, static_cast<int>(o.top), static_cast<int>(o.max_estimates));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout.precision(4);
  std::cout << "suggest: " << s.candidates << " plans for " << w.size() << " ranks, " << s.refused
            << " refused by the planner, " << s.estimated << " run dry, " << s.fitting.size() << " fit in "
            << format_bytes(w.memory_per_rank) << " per rank (" << seconds << " s)\n";
  for (const auto& c : s.fitting) {
    std::cout << "  " << c.name << ": step " << c.step_s() << " s (compute " << c.compute_s << ", communication "
              << c.comm_s << ", bubble " << c.bubble << "), peak " << format_bytes(c.peak) << "\n";
  }
  for (const auto& c : s.unfit) {
    std::cout << "  over the memory: " << c.name << ", peak " << format_bytes(c.peak) << "\n";
  }
  if (s.fitting.empty()) {
    throw UserError("no plan of " + given.model.name + " fits " + format_bytes(w.memory_per_rank) + " per rank on " +
                    std::to_string(w.size()) + " ranks among the " + std::to_string(s.estimated) +
                    " cheapest; give more ranks or memory, a smaller train.global_batch or data.seq_len, or a larger "
                    "--max-estimates" + (s.first_refusal.empty() ? "" : " (e.g. refused: " + s.first_refusal + ")"));
  }
  const std::string path = o.out.empty() ? "runs/" + given.name + "/suggested.yaml" : o.out;
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  // The best as asked; each runner-up k beside it as <stem>.<k>.yaml.
  for (size_t k = 0; k < s.fitting.size(); ++k) {
    std::filesystem::path file = path;
    if (k) file.replace_extension(std::to_string(k + 1) + file.extension().string());
    std::ofstream f(file);
    f << suggested_yaml(s, w, k);
    if (!f.good()) throw UserError("--out " + file.string() + ": cannot write the suggested config");
  }
  std::cout << "wrote " << path << (s.fitting.size() > 1 ? " (runners-up beside it, .2.yaml ...)" : "") << "\n";
  return 0;
}

std::string out_dir_of(const CliOptions& o, const ExperimentConfig& c) {
  return o.out.empty() ? "runs/" + c.name : o.out;
}

}  // namespace composer

#include "runner/estimate/estimate.h"
#include "runner/cli/cli.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <memory>
#include <sstream>
#include <tuple>

#include "runner/checkpoint/export.h"
#include "runner/verify/golden.h"
#include "runner/cli/plan_report.h"
#include "runner/suggest/suggest.h"
#include "runner/train/build.h"
#include "runner/train/trainer.h"

namespace composer {
namespace {

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

}  // namespace

int run_check(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank) {
  // Fail before training when it is missing or made for another experiment;
  // its tensors are read again after training, so that what this rank holds
  // while it trains (memory.rank<r>.json) is what `composer run` holds.
  read_checked_golden(c);
  std::string dir = prepare_out_dir(o, c);
  // A golden that carries its initial weights is checked from them (GoldenStart).
  std::optional<GoldenStart> start;
  const std::string init = golden_init_path(golden_path(c));
  if (draws_initial_weights(c.model) && std::filesystem::exists(init)) start = GoldenStart{init};
  TrainResult r = train(c, p, rank, dir, /*checkpoints=*/false, {}, start ? &*start : nullptr);
  if (!rank.is_main()) return 0;
  const Golden g = read_checked_golden(c);
  CompareReport rep = compare(g, c, r.steps, read_safetensors(dir + "/final.safetensors"));
  std::cout.precision(3);
  if (start) {
    std::cout << rank.log_prefix << "initial weights: drawn within " << start->worst
              << " of each tensor's largest magnitude of the golden's (" << start->worst_name
              << "); trained from the golden's\n";
    if (start->worst > kGoldenInitTolerance) {
      std::ostringstream why;
      why.precision(9);
      why << "the initial weights drawn are not those the golden was trained from: " << start->worst_name
          << " element " << start->worst_index << " was drawn as " << start->worst_drawn << ", the golden's is "
          << start->worst_golden << " (" << start->worst << " of the tensor's largest magnitude, beyond the "
          << kGoldenInitTolerance << " another CPU's random fills explain). The model's initialisation changed: "
          << "write the golden again (tools/reference/regenerate, docs/testing.md)";
      throw CheckFailed(why.str());
    }
  }
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

int run_plan(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext&) {
  if (o.json) {
    nlohmann::json j = plan_json(c, p);
    if (o.plan.samples > 0) j["samples"] = preview_samples(c, o.plan.samples);
    std::cout << j.dump(2) << "\n";
  } else {
    print_plan(std::cout, c, p);
    if (o.plan.samples > 0) print_samples(std::cout, preview_samples(c, o.plan.samples));
  }
  return 0;
}

int run_train(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank) {
  std::string dir = prepare_out_dir(o, c);
  TrainResult r = train(c, p, rank, dir, /*checkpoints=*/c.checkpoint.enabled);
  if (rank.is_main()) print_train_summary(r, dir);
  return 0;
}

int run_golden(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank) {
  TORCH_INTERNAL_ASSERT(c.parallelize.empty() && p.world_size == 1, "composer golden runs the single-device twin");
  std::string dir = prepare_out_dir(o, c);
  TrainResult r = train(c, p, rank, dir);
  if (auto why = degenerate_steps(r.steps)) {
    throw UserError("refusing to write the golden " + golden_path(c) + ": " + *why +
                    "; change the seed, learning rate or loss so every step trains");
  }
  write_golden(golden_path(c), make_golden(c, r.steps, read_safetensors(dir + "/final.safetensors"), o.command_line));
  std::cout << "wrote " << golden_path(c) << "\n";
  if (draws_initial_weights(c.model)) {  // what composer check trains from
    const std::string init = golden_init_path(golden_path(c));
    std::filesystem::copy_file(dir + "/init.safetensors", init, std::filesystem::copy_options::overwrite_existing);
    std::cout << "wrote " << init << "\n";
  }
  return 0;
}

int run_diff_side(const CliOptions& o, const ExperimentConfig& c, const Plan& p, RankContext& rank) {
  std::string dir = prepare_out_dir(o, c);
  TrainResult r =
      train(c, p, rank, dir, /*checkpoints=*/false, RecordOptions{o.record_step, dir + "/record", o.modules});
  if (rank.is_main()) {
    write_golden(dir + "/golden.json",
                 make_golden(c, r.steps, read_safetensors(dir + "/final.safetensors"), o.command_line));
  }
  return 0;
}

int run_export(const CliOptions& o, const ExperimentConfig& c, const Plan&, RankContext&) {
  ExportOptions e;
  e.checkpoint = o.exporting.checkpoint;
  e.weights = o.exporting.weights;
  e.out = o.out;
  e.format = o.exporting.format == "hf" ? ExportFormat::kHf : o.exporting.format == "peft" ? ExportFormat::kPeft
                                                                                          : ExportFormat::kPt;
  e.merge = o.exporting.merge;
  if (!o.exporting.max_shard_size.empty()) {
    e.max_shard_bytes = parse_byte_size(o.exporting.max_shard_size, "--max-shard-size");
  }
  for (const auto& line : export_weights(c, e)) std::cout << line << "\n";
  return 0;
}

namespace {

// The world suggest prices plans for: the options given, else the config's
// memory and this machine's measured rates (CPU) or a GPU's defaults.
World suggest_world(const CliOptions& o, const ExperimentConfig& given, int64_t ranks_per_node, int64_t nodes) {
  World w;
  w.ranks_per_node = ranks_per_node;
  w.nodes = nodes;
  w.cuda = given.mesh.device == DeviceKind::kCuda;
  if (!o.suggest.device_memory.empty()) {
    w.memory_per_rank = static_cast<int64_t>(parse_byte_size(o.suggest.device_memory, "--device-memory"));
  } else if (given.mesh.memory_per_rank_mb > 0 || !w.cuda) {
    w.memory_per_rank = memory_per_rank(given, w.ranks_per_node);
  } else {
    throw UserError("composer suggest of a cuda config needs --device-memory (e.g. 80GB) or mesh.memory_per_rank_mb");
  }
  if (!o.suggest.rates.empty()) {
    w.rates = rates_from_file(o.suggest.rates, w.cuda);
  } else if (w.cuda) {
    w.rates = gpu_default_rates();
  } else {
    w.rates = probe_machine(w.ranks_per_node, rank_threads(given.train, w.ranks_per_node), o.suggest.probe);
  }
  w.overlap = w.cuda ? 0.8 : 0.0;  // NCCL on its own streams; Gloo's copies share the compute cores
  if (o.suggest.matmul_tflops > 0) {
    w.rates.matmul_flops = o.suggest.matmul_tflops * 1e12;
    w.rates.shapes.clear();
    w.rates.measure = false;
  }
  if (o.suggest.intra_gbs > 0) {
    w.rates.intra.bytes_per_s = o.suggest.intra_gbs * 1e9;
    for (auto& [g, link] : w.rates.intra_by_size) link.bytes_per_s = o.suggest.intra_gbs * 1e9;
  }
  if (o.suggest.inter_gbs > 0) w.rates.inter.bytes_per_s = o.suggest.inter_gbs * 1e9;
  return w;
}

// "67.06 GiB per rank (74.51 GiB less 10% kept free)": the memory a plan may use.
std::string usable_memory(const World& w) {
  return format_bytes(static_cast<int64_t>(w.usable())) + " per rank (" + format_bytes(w.memory_per_rank) + " less " +
         std::to_string(static_cast<int>(std::lround(w.margin * 100))) + "% kept free)";
}

// The ranking: the plans that fit with their priced step, then those over the memory.
void print_suggestion(const Suggestion& s, const World& w, double seconds) {
  std::cout.precision(4);
  std::cout << "suggest: " << s.candidates << " plans priced for " << w.size() << " ranks; in cost order "
            << s.floored << " passed over (memory floor over the limit), " << s.dominated
            << " as certainly over as a plan run dry, " << s.planned << " put to the planner, "
            << s.refused << " refused, " << s.estimated << " run dry, " << s.fitting.size() << " fit"
            << (s.out_of_time ? " (dry runs stopped at --max-seconds)" : "")
            << (s.memory_first ? " (memory-bound: after a third of --max-seconds, least memory floor first)" : "")
            << " in " << usable_memory(w) << " ("
            << seconds << " s)\n";
  for (const auto& c : s.fitting) {
    std::cout << "  " << c.name << ": step " << c.step_s() * 1e3 << " ms (compute " << c.terms.compute_s() * 1e3
              << ", communication " << c.terms.comm_s() * 1e3 << ", bubble " << c.terms.bubble << "), peak "
              << format_bytes(c.peak) << "\n";
  }
  if (s.fitting.size() > 1) std::cout << "why: " << explain_choice(s.fitting[0], s.fitting[1]) << "\n";
  for (const auto& c : s.unfit) {
    std::cout << "  over the memory: " << c.name << ", peak " << (c.stopped ? "over " : "") << format_bytes(c.peak)
              << "\n";
  }
}

// The best plan's config at `out` (--out, default runs/<name>/suggested.yaml)
// and each runner-up k beside it as <stem>.<k>.yaml.
// A --out that names a folder (or ends in '/': one made for it) gets suggested.yaml in it.
void write_suggested(const Suggestion& s, const World& w, const std::string& out, bool quiet) {
  std::error_code ec;
  const bool folder = std::filesystem::is_directory(out, ec) || (!out.empty() && out.back() == '/');
  const std::string path = folder ? (out.back() == '/' ? out : out + "/") + "suggested.yaml" : out;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  for (size_t k = 0; k < s.fitting.size(); ++k) {
    std::filesystem::path file = path;
    if (k) file.replace_extension(std::to_string(k + 1) + file.extension().string());
    std::ofstream f(file);
    f << suggested_yaml(s, w, k);
    if (!f.good()) throw UserError("--out " + file.string() + ": cannot write the suggested config");
  }
  if (!quiet) std::cout << "wrote " << path << (s.fitting.size() > 1 ? " (runners-up beside it, .2.yaml ...)" : "") << "\n";
}

}  // namespace

int run_suggest(const CliOptions& o) {
  check_suggest_overrides(o.sets);
  const ExperimentConfig given = load_config(o.config, o.sets);  // its errors point at the file
  if (!o.suggest.from_run.empty()) {
    int64_t world = 1;
    for (int64_t d : given.mesh.shape) world *= d;
    const Plan plan = make_plan(given, world);
    World w = suggest_world(o, given, world, 1);
    if (!o.json) std::cout << w.rates.describe() << "\n";
    for (const auto& line : compare_with_run(o.suggest.from_run, given, plan, w)) std::cout << line << "\n";
    return 0;
  }
  World w = suggest_world(o, given, o.suggest.ranks_per_node, o.suggest.nodes);
  if (!o.json) std::cout << w.rates.describe() << "\n";
  const auto t0 = std::chrono::steady_clock::now();
  Suggestion s =
      suggest(o.config, o.sets, w, static_cast<int>(o.suggest.top), static_cast<int>(o.suggest.max_estimates),
              o.suggest.max_seconds, [&](const Candidate& c, double seconds) {
                if (o.json) return;
                std::cout << "  run dry: " << c.name << ", peak " << (c.stopped ? "over " : "") << format_bytes(c.peak)
                          << " (floor "
                          << format_bytes(static_cast<int64_t>(c.floor)) << "), " << (c.fits ? "fits" : "over")
                          << " (" << seconds << " s)" << std::endl;
              });
  if (o.json) {
    std::cout << suggestion_json(s, w).dump(1) << "\n";
  } else {
    print_suggestion(s, w, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (s.fitting.empty()) {
    throw UserError("no plan of " + given.model.name + " fits " + usable_memory(w) + " on " + std::to_string(w.size()) + " ranks among the " + std::to_string(s.estimated) +
                    " cheapest run dry (" + std::to_string(s.floored) + " more passed over by their memory floor, " + std::to_string(s.dominated) +
                    " as needing more than a plan run dry); give more ranks or memory, a smaller train.global_batch or data.seq_len, or a larger "
                    "--max-estimates" + (s.first_refusal.empty() ? "" : " (e.g. refused: " + s.first_refusal + ")"));
  }
  write_suggested(s, w, o.out.empty() ? "runs/" + given.name + "/suggested.yaml" : o.out, o.json);
  return 0;
}

std::string out_dir_of(const CliOptions& o, const ExperimentConfig& c) {
  if (o.command == Command::kScore && !o.out.empty()) {  // --out names the scores file
    const std::string dir = std::filesystem::path(o.out).parent_path().string();
    return dir.empty() ? "." : dir;
  }
  return o.out.empty() ? "runs/" + c.name : o.out;
}

}  // namespace composer

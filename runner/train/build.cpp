#include "runner/train/build.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include <unistd.h>

#include "models/registry.h"
#include "models/select.h"
#include "runner/checkpoint/checkpoint.h"
#include "runner/checkpoint/dcp_import.h"
#include "runner/checkpoint/weight_source.h"
#include "runner/train/datasets.h"
#include "runner/plan/plan_fp8.h"
#include "runner/plan/plan_lora.h"
#include "runner/plan/plan_mesh.h"
#include "runner/train/materialise.h"

namespace composer {
namespace {

// The key that names the model's initial weights (from_hf or init_from), for errors.
const SourceRef& weights_ref(const ModelConfig& m) { return m.from_hf.empty() ? m.init_from_ref : m.from_hf_ref; }

// per_rank_seed: the seed of this rank's own initial values of its per-rank
// parameters, the seed plus the rank's index over the data-parallel ranks
// (-1: they start from the single-device values).
int64_t own_seed(const Plan& plan, RankContext& rank) {
  if (!plan.per_rank || plan.per_rank->seed < 0 || !rank.mesh) return -1;
  return plan.per_rank->seed + rank.mesh->group(plan.per_rank->mesh_dim).rank;
}

// A model built whole: the per-rank parameters get the model's init under
// own_seed. The random state the rest of the run sees is left as it was.
void init_per_rank(const ExperimentConfig& c, const Plan& plan, RankContext& rank, models::Model& model) {
  const int64_t seed = own_seed(plan, rank);
  if (seed < 0) return;
  auto gen = at::detail::getDefaultCPUGenerator();
  const auto state = gen.get_state();
  torch::manual_seed(static_cast<uint64_t>(seed));
  models::ModelPtr own = models::find_model(c.model.name)->build(c.model.args);
  gen.set_state(state);
  parallel::copy_per_rank(model, *own, plan.per_rank->patterns);
}

// Moves a model built on the CPU to the rank's GPU in place (the tensors keep
// their identity, so the transforms' maps stay valid): every parameter and
// buffer, or only the buffers of a model whose parameters are still on meta.
void move_model(models::Model& model, c10::Device device, bool parameters) {
  if (device.is_cpu()) return;
  torch::NoGradGuard no_grad;
  if (parameters) {
    model.to(device);
    return;
  }
  for (auto& b : model.buffers()) b.set_data(b.to(device));
}

// Records in `start` how far a drawn initial value is from the golden's (main rank).
void measure_start(GoldenStart& start, const std::string& name, const torch::Tensor& drawn,
                   const torch::Tensor& golden) {
  const torch::Tensor d = drawn.to(torch::kDouble).reshape(-1), g = golden.to(torch::kDouble).reshape(-1);
  if (g.numel() == 0) return;
  const double scale = std::max(g.abs().max().item<double>(), std::numeric_limits<double>::min());
  const torch::Tensor err = (d - g).abs();
  const int64_t at = err.argmax().item<int64_t>();
  const double share = err[at].item<double>() / scale;
  if (!start.worst_name.empty() && share <= start.worst) return;
  start = GoldenStart{start.path, share, name, at, d[at].item<double>(), g[at].item<double>()};
}

// A model built whole: the golden's initial weights replace the drawn ones.
void take_golden_start(models::Model& model, GoldenStart& start, bool measure) {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> golden;
  for (auto& [name, t] : read_safetensors(start.path)) golden.emplace(name, t);
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    auto it = golden.find(name);
    if (it == golden.end() || it->second.sizes() != p.sizes()) {
      throw CheckFailed(start.path + " has no initial value for " + name + " (or one of another shape)" +
                        ": the golden was written for another model; write it again (docs/testing.md)");
    }
    if (measure) measure_start(start, name, p, it->second);
    p.copy_(it->second);
  }
}

}  // namespace

models::ModelPtr build_model(const ExperimentConfig& c) {
  const models::ModelSpec* spec = models::find_model(c.model.name);
  TORCH_INTERNAL_ASSERT(spec, "model ", c.model.name, " passed config validation but is not registered");
  torch::manual_seed(c.seed);
  models::ModelPtr model = spec->build(c.model.args);
  attach_lora(*model, c.train.lora);  // its draws follow the base's
  if (!nn::param_options().device().is_meta()) {  // values, not shapes
    naming_config_key(weights_ref(c.model), [&] {
      if (auto source = WeightSource::open(c.model, c.train.lora)) load_weights(*model, *source, drawn_adapters(c));
    });
  }
  return model;
}

namespace {

// Why composer could not write into the folder `path`, creating it if need be ("" when it can).
std::string folder_problem(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::exists(p, ec)) {
    if (!fs::is_directory(p, ec)) return "is a file, not a folder";
    return access(path.c_str(), W_OK | X_OK) == 0 ? "" : "is a folder this user cannot write into";
  }
  fs::path above = p.parent_path();  // the nearest folder that exists holds what is created
  while (!above.empty() && !fs::exists(above, ec)) above = above.parent_path();
  if (above.empty()) above = ".";
  if (!fs::is_directory(above, ec)) return "cannot be created: " + above.string() + " is a file, not a folder";
  if (access(above.c_str(), W_OK | X_OK) != 0) return "cannot be created: this user cannot write into " + above.string();
  return "";
}

// The folders a run writes into, before it starts: each one a folder composer can create or write into.
void check_folders(const ExperimentConfig& c, const std::string& out_dir) {
  auto check = [](const SourceRef& ref, const std::string& path, const char* key) {
    if (path.empty()) return;
    const std::string why = folder_problem(path);
    if (!why.empty()) {
      throw ConfigError(ref, path + " " + why + "; set " + key + " to a folder composer can create or write into");
    }
  };
  check(c.metrics.tensorboard_ref, c.metrics.tensorboard, "metrics.tensorboard");
  if (!c.profile.steps.empty()) check(c.profile.dir_ref, c.profile.dir, "profile.dir");
  if (c.checkpoint.enabled) check(c.checkpoint.dir_ref, c.checkpoint.dir, "checkpoint.dir");
  const std::string why = folder_problem(out_dir);
  if (!why.empty()) throw UserError("--out " + out_dir + " " + why + "; give --out a folder composer can create or write into");
}


}  // namespace

DataPlan shape_data_plan(const ExperimentConfig& c) {
  nn::ShapeOnly shapes;
  models::ModelPtr model = build_model(c);  // shapes only: nothing is read
  naming_config_key(weights_ref(c.model), [&] {
    if (auto source = WeightSource::open(c.model, c.train.lora)) source->match(*model, {}, drawn_adapters(c));
  });
  model->to(scalar_type_of(c.train.dtype));
  return plan_data(c, *model);
}

nlohmann::json preview_samples(const ExperimentConfig& c, int64_t n) {
  const auto data = make_dataset(c, shape_data_plan(c));
  nlohmann::json out = nlohmann::json::array();
  for (int64_t g = 0; g < n; ++g) {
    nlohmann::json w = data->where(g);
    if (w.is_null()) {
      throw UserError("--samples shows where token-file samples come from; data.source " +
                      std::string(name_of(c.data.source)) + " draws each sample from (seed, step, index)");
    }
    w["step"] = g / c.train.global_batch + 1;
    out.push_back(std::move(w));
  }
  return out;
}

void preflight(const ExperimentConfig& c, const std::string& out_dir, bool resume) {
  check_folders(c, out_dir);
  const DataPlan data = shape_data_plan(c);
  make_dataset(c, data)->check_all();  // opens the data files, checks their sizes, dtypes and values
  if (c.eval.every > 0) make_dataset(eval_data_config(c), shape_data_plan(eval_data_config(c)))->check_all();
  if (!resume) return;
  import_dcp_if_needed(c, out_dir);  // checkpoint.resume_from_dcp, once, before the ranks look for a checkpoint
  const std::string from = Checkpointer(c, out_dir, 0, nullptr).resume_path();
  if (from.empty()) return;
  check_resumable(c, from);
  check_frozen_base(c, from);
}

int rank_threads(const TrainConfig& t, int64_t local_ranks) {
  const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  return static_cast<int>(t.threads ? t.threads : std::max<int64_t>(1, cores / std::max<int64_t>(1, local_ranks)));
}

namespace {

// Whether a train.freeze pattern names the parameter `name` or a module that holds it.
bool freezes(const std::string& pattern, const std::string& name) {
  for (size_t end = name.size(); end != std::string::npos; end = end ? name.rfind('.', end - 1) : std::string::npos) {
    if (models::fqn_matches(pattern, name.substr(0, end))) return true;
    if (end == 0) break;
  }
  return false;
}

}  // namespace

std::set<std::string> frozen_names(models::Model& model, const TrainConfig& t) {
  const auto named = nn::unique_named_parameters(model);
  for (const auto& pattern : t.freeze) {
    if (std::none_of(named.begin(), named.end(), [&](const auto& np) { return freezes(pattern, np.first); })) {
      throw ConfigError(t.freeze_ref, "'" + pattern + "' names no parameter of the model (nor a module "
                                      "holding one), e.g. " + named.front().first + " or " + named.back().first +
                                      "; fix the pattern ('*' within a dotted segment, '**' across) or remove it");
    }
  }
  std::set<std::string> out;
  for (const auto& [name, p] : named) {
    const bool base = t.lora && !is_lora_name(name);  // train.lora: only the adapters train
    if (base || std::any_of(t.freeze.begin(), t.freeze.end(), [&](const std::string& f) { return freezes(f, name); })) {
      out.insert(name);
    }
  }
  if (!named.empty() && out.size() == named.size()) {
    throw ConfigError(t.freeze_ref, "these patterns freeze every parameter of the model: nothing would train; "
                                    "name only the parameters to keep fixed");
  }
  return out;
}

namespace {

// train.freeze: the parameters it names stop requiring gradients, before the
// transforms, which keep each parameter's requires_grad (sharding replaces a
// parameter's data, not the parameter) and leave out of their gradient
// reductions the ones that need none.
void freeze_parameters(models::Model& model, const TrainConfig& t, RankContext& rank) {
  if (t.freeze.empty() && !t.lora) return;
  const auto named = nn::unique_named_parameters(model);
  const std::set<std::string> names = frozen_names(model, t);
  int64_t numel = 0, total = 0;
  for (const auto& [name, p] : named) {
    total += p.numel();
    if (!names.count(name)) continue;
    p.requires_grad_(false);
    numel += p.numel();
  }
  if (rank.is_main()) {
    std::cout << rank.log_prefix << (t.lora ? "train.lora: " : "train.freeze: ") << names.size() << " of "
              << named.size() << " parameters frozen (" << numel << " of " << total << " values); "
              << named.size() - names.size() << " train\n";
  }
}

}  // namespace

parallel::Parallel apply_plan(models::Model& model, const ExperimentConfig& c, const Plan& plan, RankContext& rank,
                              std::function<torch::Tensor()> microbatch) {
  freeze_parameters(model, c.train, rank);
  parallel::ParallelizeOptions o;
  if (rank.mesh) {
    o.mesh = rank.mesh.get();
    o.world = &rank.mesh->world();
    if (!plan.dp_dims.empty()) o.data_parallel = &rank.mesh->group(plan.dp_dims);
  }
  o.device = rank.device;
  o.microbatch = std::move(microbatch);
  const c10::ScalarType dtype = scalar_type_of(c.train.dtype);
  o.shape_twin = [&c, dtype] {
    nn::ShapeOnly shapes;
    models::ModelPtr copy = models::find_model(c.model.name)->build(c.model.args);
    copy->to(dtype);
    return copy;
  };
  if (rank.is_main()) o.log = [&rank](const std::string& line) { std::cout << rank.log_prefix << line << "\n"; };
  mark_fp8_layers(model, c.train.fp8);  // before the transforms, which see which layers are float8
  parallel::Parallel par = parallel::parallelize(model, plan.steps(), o);
  if (rank.mesh) {
    const std::string cp = context_parallel_dim(c);
    reduce_fp8_scales(model, c.train.fp8, o.data_parallel, cp.empty() ? nullptr : &rank.mesh->group(cp));
  }
  return par;
}

namespace {

// A model built on meta gets its values (materialise.h): each parameter only
// where this rank holds it, drawn as a single-device build draws it, or read
// from init_from, from_hf or the golden's start; the main rank writes them all
// to init.safetensors.
void give_held_values(const ExperimentConfig& c, const Plan& plan, RankContext& rank, const std::string& out_dir,
                      const std::vector<nn::DeferInit::Step>& init_steps, GoldenStart* start, models::Model& model,
                      parallel::Parallel& par) {
  MaterialiseOptions m;
  const c10::Device device = rank.device;
  parallel::FullyShard* fsdp = par.fsdp.get();
  m.device_of = [fsdp, device](const torch::Tensor& p) {
    return fsdp && fsdp->offloads(p) ? c10::Device(c10::kCPU) : device;
  };
  m.pin_host = device.is_cuda();
  m.own = &par.per_rank;
  // init_from or from_hf hold the base: the adapters are drawn (a golden's start holds them too)
  if (!start) m.drawn = drawn_adapters(c);
  m.own_seed = own_seed(plan, rank);
  m.dtype = scalar_type_of(c.train.dtype);
  m.placements = par.placements.get();
  if (rank.is_main() && !out_dir.empty()) m.write_init = out_dir + "/init.safetensors";
  if (start && rank.is_main()) {
    m.replaced = [start](const std::string& name, const torch::Tensor& drawn, const torch::Tensor& given) {
      measure_start(*start, name, drawn, given);
    };
  }
  naming_config_key(weights_ref(c.model), [&] {
    const std::unique_ptr<WeightSource> source = start ? WeightSource::file(start->path) : WeightSource::open(c.model, c.train.lora);
    m.init = source.get();
    materialise(model, init_steps, m);
  });
}

}  // namespace

RankModel build_rank_model(const ExperimentConfig& c, const Plan& plan, RankContext& rank, const std::string& out_dir,
                           GoldenStart* start) {
  RankModel out;
  if (rank.is_main() && !out_dir.empty() && !c.model.from_hf.empty()) {
    naming_config_key(weights_ref(c.model), [&] {
      const std::string note = WeightSource::open(c.model, c.train.lora)->skipped_note();
      if (!note.empty()) std::cout << rank.log_prefix << note << std::endl;
    });
  }
  // A plan that shards or splits the model: the model is built on meta, the
  // transforms decide what this rank holds, and only that is given values
  // (materialise.h); the values equal a single-device build's.
  bool owned_only = plan.splits_model && rank.mesh;
  std::vector<nn::DeferInit::Step> init_steps;
  if (owned_only) {
    nn::DeferInit defer;
    out.model = build_model(c);
    init_steps = defer.steps();
  }
  if (owned_only && !fully_recorded(*out.model, init_steps)) {  // a model that sets a value another way: build it whole
    owned_only = false;
    init_steps.clear();
  }
  if (!owned_only) {
    out.model = build_model(c);
    if (start) take_golden_start(*out.model, *start, rank.is_main());
    init_per_rank(c, plan, rank, *out.model);  // rank 0's own values are in init.safetensors
  }
  models::Model& model = *out.model;
  if (rank.is_main() && !owned_only && !out_dir.empty()) save_weights(model, out_dir + "/init.safetensors");
  model.to(scalar_type_of(c.train.dtype));
  model.train();
  // A GPU run builds the model on the CPU (every value drawn as a
  // single-device CPU build draws it) and trains on the GPU; the transforms'
  // buffers are made there too.
  const c10::Device device = rank.device;
  move_model(model, device, /*parameters=*/!owned_only);
  nn::OnDevice run_on(device);

  out.data = plan_data(c, model);
  if (rank.is_main() && !out_dir.empty()) write_json(out_dir + "/config.resolved.json", resolved_json(c, out.data));
  out.dataset = make_dataset(c, out.data);
  if (c.eval.every > 0) {  // eval's own seq_len, when eval.seq_len gives one
    const ExperimentConfig e = eval_data_config(c);
    out.eval_dataset = make_dataset(e, plan_data(e, model));
  }
  if (rank.is_main()) {  // a blend: how many samples each source gives this run
    const std::string blend = out.dataset->describe(1, c.train.steps);
    if (!blend.empty()) std::cout << rank.log_prefix << blend << std::endl;
  }
  DataSet* data = out.dataset.get();
  const int64_t mb = plan.local_microbatch;
  out.par = apply_plan(model, c, plan, rank, [data, mb] { return data->batch(1, 0, mb).inputs; });
  out.par.device = device;
  if (owned_only) give_held_values(c, plan, rank, out_dir, init_steps, start, model, out.par);
  out.par.derive_grad_sync();
  return out;
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw RuntimeFailure("cannot write " + path);
}

nlohmann::json resolved_json(const ExperimentConfig& c, const DataPlan& data) {
  nlohmann::json j = to_json(c);
  j["data"]["inputs"] = name_of(data.inputs);
  j["data"]["targets"] = name_of(data.targets);
  j["data"]["seq_len"] = data.seq_len;
  j["data"]["output_shape"] = data.output_shape;
  j["data"]["features"] = data.input.features;
  j["data"]["vocab_size"] = data.input.vocab_size;
  j["config_hash"] = config_hash(c);
  j["format_version"] = 1;
  return j;
}

}  // namespace composer

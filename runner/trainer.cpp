#include "runner/trainer.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include "models/registry.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/pipeline.h"
#include "parallelisms/replicate.h"
#include "parallelisms/tensor_parallel.h"
#include "runner/checkpoint.h"
#include "runner/export.h"
#include "runner/materialise.h"
#include "runner/memory.h"
#include "runner/optim.h"
#include "runner/step.h"

namespace composer {
namespace {

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw RuntimeFailure("cannot write " + path);
}

// The parameters data parallelism spreads: a pipeline rank's own stages',
// never the per-rank ones; nullptr: every parameter.
std::function<bool(const torch::Tensor&)> data_parallel_filter(const Parallel& p) {
  if (!p.pipe && p.per_rank.empty()) return nullptr;
  parallel::Pipeline* pipe = p.pipe.get();
  return [pipe, own = p.per_rank](const torch::Tensor& param) {
    return (!pipe || pipe->holds(param)) && !own.count(param.unsafeGetTensorImpl());
  };
}

parallel::FullyShardOptions fully_shard_options(const TransformConfig& t, Parallel& p, RankContext& rank) {
  parallel::FullyShardOptions o;
  o.units = t.units;
  o.reshard_after_forward = t.reshard_after_forward;
  o.prefetch = t.prefetch;
  if (t.param_dtype) o.param_dtype = scalar_type_of(*t.param_dtype);
  if (t.reduce_dtype) o.reduce_dtype = scalar_type_of(*t.reduce_dtype);
  if (t.all_gather != AllGather::kPlain) o.extension = parallel::make_all_gather_extension(name_of(t.all_gather));
  if (t.shard_placement == ShardPlacement::kOppositeTp && p.tp) {
    parallel::TensorParallel* tp = p.tp.get();
    o.shard_dim = [tp](const torch::Tensor& param) -> int64_t {  // shard the dim tp does not
      const parallel::TpShard* s = tp->shard_of(param);
      return s ? param.dim() - 1 - s->dim : 0;
    };
  }
  if (t.mesh_dim.size() == 2) o.replicate = &rank.mesh->group(t.mesh_dim[0]);  // HSDP: [replicate, shard]
  o.param_filter = data_parallel_filter(p);
  if (p.pipe) {  // shard this rank's stages only; the stage pieces never run the model's own forward
    parallel::Pipeline* pipe = p.pipe.get();
    o.module_filter = [pipe](const std::string& fqn) { return pipe->runs(fqn); };
    o.cast_at_units = true;
  }
  o.placements = p.placements.get();
  o.offload = t.offload == Offload::kCpu && rank.device.is_cuda();
  if (t.offload == Offload::kCpu && !o.offload && rank.is_main()) {
    std::cout << rank.log_prefix << "fully_shard offload: cpu: this is a CPU run, shards and optimizer state "
              << "already live in host memory; nothing to move\n";
  }
  return o;
}

void apply_activation_checkpointing(models::Model& model, const Plan& plan, Parallel& p) {
  for (const auto& t : plan.transforms) {
    if (t.kind == TransformKind::kActivationCheckpointing) {
      p.ac = parallel::apply_activation_checkpointing(model, {t.units, t.every});
    }
  }
}

Parallel apply_transforms(models::Model& model, const Plan& plan, RankContext& rank, const torch::Tensor& example) {
  Parallel p;
  // Activation checkpointing changes how a unit computes, not where: alone it
  // needs no mesh, and the run is a single-device one.
  bool distributed = false;
  for (const auto& t : plan.transforms) distributed = distributed || t.kind != TransformKind::kActivationCheckpointing;
  if (!rank.mesh || !distributed) {
    apply_activation_checkpointing(model, plan, p);
    return p;
  }
  p.any = true;
  p.world = &rank.mesh->world();
  if (!plan.dp_dims.empty()) p.dp = &rank.mesh->group(plan.dp_dims);
  // Tensor parallelism shards the math first; activation checkpointing wraps
  // the sharded units (their recompute re-runs the tensor-parallel
  // collectives); a pipeline then keeps only its stages' parameters, and data
  // parallelism shards or replicates what this rank holds (its hooks run
  // around the checkpointed forward, so a unit is gathered before it).
  for (const auto& t : plan.transforms) {
    if (t.kind == TransformKind::kTensorParallel) {
      p.tp = parallel::apply_tensor_parallel(model, rank.mesh->group(t.mesh_dim), plan.tp_plan, *p.placements);
    }
  }
  apply_activation_checkpointing(model, plan, p);
  for (const auto& t : plan.transforms) {
    if (t.kind != TransformKind::kPipeline) continue;
    parallel::PipelineOptions o;
    o.schedule = t.schedule;
    o.virtual_stages = static_cast<int>(t.virtual_stages);
    o.microbatches = static_cast<int>(plan.pp_microbatches);
    o.split_points = t.split_points;
    o.layers_per_stage = t.layers_per_stage;
    o.placements = p.placements.get();
    const std::string dim = t.mesh_dim.front();
    o.subgroup = [&rank, dim](const std::vector<int>& members) { return &rank.mesh->subgroup(dim, members); };
    p.pipe = std::make_unique<parallel::Pipeline>(model, rank.mesh->group(t.mesh_dim), o, example);
  }
  for (const auto& t : plan.transforms) {
    if (!t.per_rank.empty()) {
      p.per_rank = parallel::apply_per_rank(model, rank.mesh->group(t.mesh_dim), t.per_rank, *p.placements);
    }
  }
  for (const auto& t : plan.transforms) {
    if (t.kind == TransformKind::kFullyShard) {
      p.fsdp = parallel::apply_fully_shard(model, rank.mesh->group(t.mesh_dim.back()), fully_shard_options(t, p, rank));
    } else if (t.kind == TransformKind::kReplicate) {
      parallel::ReplicateOptions o;
      o.param_filter = data_parallel_filter(p);  // this rank's stages only, not the per-rank parameters
      parallel::apply_replicate(model, rank.mesh->group(t.mesh_dim), o, *p.placements);
    }
  }
  return p;
}

// The parameters this rank trains (a pipeline rank holds its stages' only).
std::vector<torch::Tensor> held_params(models::Model& model, const Parallel& par) {
  std::vector<torch::Tensor> params;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    if (!par.pipe || par.pipe->holds(p)) params.push_back(p);
  }
  return params;
}

// The gradient synchronisation: every reduction the placements call for.
void add_grad_sync(models::Model& model, const Plan& plan, Parallel& p) {
  if (!p.any) return;
  double bucket_mb = 25;
  for (const auto& t : plan.transforms) {
    if (t.kind == TransformKind::kReplicate) bucket_mb = t.bucket_mb;
  }
  p.sync = std::make_unique<parallel::GradSync>(held_params(model, p), *p.placements,
                                                parallel::GradSyncOptions{bucket_mb});
}

// Whether this run's ranks build only what they hold: the plan shards a
// parameter (tensor_parallel, fully_shard) or splits the model (pipeline).
bool builds_owned_only(const Plan& plan, const RankContext& rank) {
  if (!rank.mesh) return false;
  for (const auto& t : plan.transforms) {
    if (t.kind == TransformKind::kTensorParallel || t.kind == TransformKind::kFullyShard ||
        t.kind == TransformKind::kPipeline) {
      return true;
    }
  }
  return false;
}

// A batch on the rank's device (the data is read on the CPU).
Batch on_device(Batch b, c10::Device device) {
  if (device.is_cpu()) return b;
  b.inputs = b.inputs.to(device);
  if (b.targets.defined()) b.targets = b.targets.to(device);
  return b;
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

// debug.inject: the wrong step a plausible bug would compute, for proving that
// the golden checks fail on it. grad_factor multiplies the gradients (a wrong
// dp divisor, scale_grads applied twice); data_shift moves the last dp rank's
// batch by one microbatch (a microbatch index off by one: one microbatch of the
// global batch dropped, one from outside it read).
struct Injection {
  double grad_factor = 1.0;
  int64_t data_shift = 0;
};

Injection injection(const ExperimentConfig& c, const Plan& plan, int64_t dp_rank, const RankContext& rank) {
  Injection in;
  if (c.debug.inject == Inject::kNone) return in;
  if (c.debug.inject == Inject::kGradX2) in.grad_factor = 2.0;
  if (c.debug.inject == Inject::kMicrobatchOffByOne && dp_rank + 1 == plan.dp_size) {
    in.data_shift = plan.pp_microbatches ? plan.local_batch / plan.pp_microbatches : plan.local_microbatch;
  }
  if (rank.is_main()) {
    std::cout << rank.log_prefix << "debug.inject: " << name_of(c.debug.inject)
              << ": this run trains wrongly on purpose\n";
  }
  return in;
}

// "250 ms before_reduce_scatter, ..." for the entries on `rank`.
std::string delay_summary(const std::vector<parallel::Delay>& delays, int rank) {
  std::string out;
  for (const auto& d : delays) {
    if (!d.ranks.empty() && std::find(d.ranks.begin(), d.ranks.end(), rank) == d.ranks.end()) continue;
    out += (out.empty() ? "" : ", ") + std::to_string(d.ms) + " ms " + parallel::name_of(d.point);
  }
  return out;
}

// per_rank_seed: the seed of this rank's own initial values of its per-rank
// parameters, the seed plus the rank's index over the data-parallel ranks
// (-1: they start from the single-device values).
int64_t own_seed(const Plan& plan, RankContext& rank) {
  for (const auto& t : plan.transforms) {
    if (!t.per_rank.empty() && t.per_rank_seed >= 0 && rank.mesh) {
      return t.per_rank_seed + rank.mesh->group(t.mesh_dim).rank;
    }
  }
  return -1;
}

// A model built whole: the per-rank parameters get the model's init under
// own_seed. The random state the rest of the run sees is left as it was.
void init_per_rank(const ExperimentConfig& c, const Plan& plan, RankContext& rank, models::Model& model) {
  const int64_t seed = own_seed(plan, rank);
  for (const auto& t : plan.transforms) {
    if (t.per_rank.empty() || seed < 0) continue;
    auto gen = at::detail::getDefaultCPUGenerator();
    const auto state = gen.get_state();
    torch::manual_seed(static_cast<uint64_t>(seed));
    models::ModelPtr own = models::find_model(c.model.name)->build(c.model.args);
    gen.set_state(state);
    parallel::copy_per_rank(model, *own, t.per_rank);
  }
}

}  // namespace

models::ModelPtr build_model(const ExperimentConfig& c) {
  const models::ModelSpec* spec = models::find_model(c.model.name);
  TORCH_INTERNAL_ASSERT(spec, "model ", c.model.name, " passed config validation but is not registered");
  torch::manual_seed(c.seed);
  models::ModelPtr model = spec->build(c.model.args);
  if (!c.model.init_from.empty() && !nn::param_options().device().is_meta()) {  // values, not shapes
    naming_config_key(c.model.init_from_ref, [&] { load_weights(*model, c.model.init_from); });
  }
  return model;
}

std::vector<std::string> describe_placements(const ExperimentConfig& c, const Plan& plan, size_t limit) {
  if (plan.transforms.empty()) return {};
  // The first rank of every pipeline stage: together they hold every parameter.
  std::vector<int> ranks{0};
  for (const auto& t : plan.transforms) {
    if (t.kind != TransformKind::kPipeline) continue;
    const auto& names = c.mesh.names;
    const size_t d = std::find(names.begin(), names.end(), t.mesh_dim.front()) - names.begin();
    int64_t stride = 1;
    for (size_t i = d + 1; i < names.size(); ++i) stride *= c.mesh.shape[i];
    for (int64_t s = 1; s < c.mesh.shape[d]; ++s) ranks.push_back(static_cast<int>(s * stride));
  }
  std::vector<std::string> names;
  std::map<std::string, std::string> lines;
  for (int r : ranks) {
    RankContext ctx;
    ctx.rank = r;
    ctx.world_size = static_cast<int>(plan.world_size);
    parallel::MeshOptions o;
    o.connect = false;
    ctx.mesh = std::make_unique<parallel::DeviceMesh>(c.mesh.names, c.mesh.shape, r, c10::intrusive_ptr<c10d::Store>(), o, plan.flat_groups);
    ctx.rank = -1;  // not the main rank: no log lines
    nn::ShapeOnly shapes;  // names and placements only
    models::ModelPtr model = build_model(c);
    model->to(scalar_type_of(c.train.dtype));
    Parallel par = apply_transforms(*model, plan, ctx, torch::Tensor());
    for (auto& [name, p] : nn::unique_named_parameters(*model)) {
      if (r == ranks.front()) names.push_back(name);
      const parallel::ShardSpec* spec = par.placements->find(p);
      if (!spec || !spec->held() || lines.count(name)) continue;
      lines[name] = name + " " + spec->str() + "; gradient: " + parallel::grad_plan(*spec).str();
    }
  }
  std::vector<std::string> out;
  for (const auto& n : names) {
    if (out.size() == limit) {
      out.push_back("... and " + std::to_string(names.size() - limit) + " more parameters");
      break;
    }
    out.push_back(lines.count(n) ? lines[n] : n + " (no placement)");
  }
  return out;
}

int rank_threads(const TrainConfig& t, int64_t local_ranks) {
  const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  return static_cast<int>(t.threads ? t.threads : std::max<int64_t>(1, cores / std::max<int64_t>(1, local_ranks)));
}

DryRun dry_run(const ExperimentConfig& c, const Plan& plan, int r, int64_t steps, const MetaBatch& meta_batch) {
  memory::MetaCount count;
  nn::ShapeOnly shapes;
  RankContext ctx;
  ctx.rank = r;
  ctx.world_size = static_cast<int>(plan.world_size);
  parallel::MeshOptions o;
  o.connect = false;
  if (!plan.transforms.empty()) {
    ctx.mesh = std::make_unique<parallel::DeviceMesh>(c.mesh.names, c.mesh.shape, r, c10::intrusive_ptr<c10d::Store>(),
                                                      o, plan.flat_groups);
  }
  ctx.rank = -1;  // not the main rank: no log lines
  DryRun out;
  models::ModelPtr model = build_model(c);
  model->to(scalar_type_of(c.train.dtype));
  model->train();
  const DataPlan data = plan_data(c, *model);
  const int64_t pp_mb = plan.pp_microbatches ? plan.local_batch / plan.pp_microbatches : 0;
  torch::Tensor example = pp_mb ? meta_batch(data, pp_mb).inputs : torch::Tensor();
  Parallel par = apply_transforms(*model, plan, ctx, example);
  add_grad_sync(*model, plan, par);
  par.device = torch::kMeta;
  std::vector<torch::Tensor> params = held_params(*model, par);
  auto optimizer = make_optimizer(c.train.optimizer, params);
  static const parallel::Delays kNoDelays({}, 0);
  StepState state{c, plan, *model, par, params, *optimizer,
                  [&](int64_t, int64_t begin, int64_t end) { return meta_batch(data, end - begin); },
                  (par.dp ? par.dp->rank : 0) * plan.local_batch, static_cast<double>(plan.dp_size), kNoDelays};
  const int64_t before = count.live(), buffers_before = buffer_bytes(par);
  for (int64_t step = 1; step <= steps; ++step) {
    reset_counters(ctx);
    count.reset_peak();
    StepRecord rec;
    rec.step = step;
    rec.lr = lr_at(c.train.optimizer, c.train.lr_schedule, step, c.train.steps);
    set_lr(*optimizer, rec.lr);
    run_step(state, rec);
    out.step_peaks.push_back(count.peak());
    if (step == 1) out.terms = memory_terms(par, params, buffers_before, before, count.live());
    out.comm = comm_bytes(ctx);
  }
  return out;
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

TrainResult train(const ExperimentConfig& c, const Plan& plan, RankContext& rank, const std::string& out_dir,
                  bool checkpoints) {
  const auto& t = c.train;
  torch::set_num_threads(rank_threads(t, rank.local_world_size));
  // A plan that shards or splits the model: the model is built on meta, the
  // transforms decide what this rank holds, and only that is given values
  // (materialise.h); the values equal a single-device build's.
  bool owned_only = builds_owned_only(plan, rank);
  std::vector<nn::DeferInit::Step> init_steps;
  models::ModelPtr model;
  if (owned_only) {
    nn::DeferInit defer;
    model = build_model(c);
    init_steps = defer.steps();
  }
  if (owned_only && !fully_recorded(*model, init_steps)) {  // a model that sets a value another way: build it whole
    owned_only = false;
    init_steps.clear();
  }
  if (!owned_only) {
    model = build_model(c);
    init_per_rank(c, plan, rank, *model);  // rank 0's own values are in init.safetensors
  }
  if (rank.is_main() && !owned_only) save_weights(*model, out_dir + "/init.safetensors");
  model->to(scalar_type_of(t.dtype));
  model->train();
  // A GPU run builds the model on the CPU (every value drawn as a
  // single-device CPU build draws it) and trains on the GPU; the transforms'
  // buffers are made there too.
  const c10::Device device = rank.device;
  move_model(*model, device, /*parameters=*/!owned_only);
  nn::OnDevice run_on(device);

  DataPlan data = plan_data(c, *model);
  if (rank.is_main()) write_json(out_dir + "/config.resolved.json", resolved_json(c, data));
  auto dataset = make_dataset(c, data);
  const int64_t pp_mb = plan.pp_microbatches ? plan.local_batch / plan.pp_microbatches : 0;
  torch::Tensor example = pp_mb ? dataset->batch(1, 0, pp_mb).inputs : torch::Tensor();
  if (example.defined()) example = example.to(owned_only ? c10::Device(torch::kMeta) : device);  // stage shapes
  Parallel par = apply_transforms(*model, plan, rank, example);
  par.device = device;
  if (owned_only) {
    MaterialiseOptions m;
    parallel::FullyShard* fsdp = par.fsdp.get();
    m.device_of = [fsdp, device](const torch::Tensor& p) {
      return fsdp && fsdp->offloads(p) ? c10::Device(c10::kCPU) : device;
    };
    m.pin_host = device.is_cuda();
    m.own = &par.per_rank;
    m.own_seed = own_seed(plan, rank);
    m.dtype = scalar_type_of(t.dtype);
    m.placements = par.placements.get();
    m.init_from = c.model.init_from;
    if (rank.is_main()) m.write_init = out_dir + "/init.safetensors";
    naming_config_key(c.model.init_from_ref, [&] { materialise(*model, init_steps, m); });
  }
  add_grad_sync(*model, plan, par);
  const int64_t setup_peak_bytes = memory::peak_bytes();  // building the model and the transforms
  const double setup_peak_rss_mb = peak_rss_mb();

  std::vector<torch::Tensor> params = held_params(*model, par);
  auto optimizer = make_optimizer(t.optimizer, params);
  std::vector<HeldParam> held;
  for (auto& [name, p] : nn::unique_named_parameters(*model)) held.push_back({name, p, par.placements->find(p)});
  for (const auto& b : model->named_buffers()) held.push_back({b.key(), b.value(), nullptr, /*buffer=*/true});
  Checkpointer checkpointer(c, out_dir, rank.rank, par.world, rank.log_prefix);
  int64_t first_step = 1;
  if (checkpoints) {
    const std::string from = checkpointer.resume_path();
    if (!from.empty()) {
      first_step = checkpointer.load(from, held, *optimizer) + 1;
      if (rank.is_main()) {
        std::cout << rank.log_prefix << "resuming from " << from << " (step " << first_step - 1 << " of " << t.steps
                  << (first_step > t.steps ? "; training is complete, checkpoint.resume: never trains again" : "")
                  << ")\n";
      }
    }
  }
  // Peak RSS in the metrics covers training; setup (building the model,
  // applying the transforms, writing init weights) is memory.rank<r>.json's
  // setup_peak_bytes and setup_peak_rss_mb.
  reset_peak_rss();
  const int64_t setup_live_bytes = memory::live_bytes();
  std::vector<int64_t> step_peaks;

  std::unique_ptr<Metrics> metrics;
  if (rank.is_main()) metrics = std::make_unique<Metrics>(out_dir + "/metrics.jsonl", t.steps, t.log_every, rank.log_prefix,
                                                               first_step - 1);
  TrainResult result;
  const int64_t dp_rank = par.dp ? par.dp->rank : 0;
  const Injection inject = injection(c, plan, dp_rank, rank);
  static const parallel::Delays kNoDelays({}, 0);
  const parallel::Delays& delays = rank.delays ? *rank.delays : kNoDelays;
  if (!delays.empty()) {
    std::cout << rank.log_prefix << "debug.delay: this rank sleeps at " << delay_summary(c.debug.delay, rank.rank)
              << "; the results must not change\n";
  }
  const int64_t batch_begin = dp_rank * plan.local_batch + inject.data_shift;
  // Each rank's loss is its share of the global-batch loss; averaging gradients
  // over the dp ranks divides by dp_size, so backward runs on dp_size x share.
  const double grad_scale = static_cast<double>(plan.dp_size) * inject.grad_factor;
  StepState state{c, plan, *model, par, params, *optimizer,
                  [&](int64_t step, int64_t begin, int64_t end) {
                    return on_device(dataset->batch(step, begin, end), device);
                  },
                  batch_begin, grad_scale, delays};
  const int64_t buffers_before = buffer_bytes(par);
  MemoryTerms terms;
  CommBytes comm;
  for (int64_t step = first_step; step <= t.steps; ++step) {
    auto start = std::chrono::steady_clock::now();
    const int64_t recomputes_before = par.ac ? par.ac->recomputes() : 0;
    const double tcp_start = rank.world_size > 1 && rank.is_main() ? tcp_tx_bytes() : -1;  // the logging rank's
    reset_counters(rank);
    memory::reset_peak();
    if (rank.cuda) rank.cuda->reset_peaks(device.index());
    if (rank.rank == c.debug.fail_rank && step == c.debug.fail_step && c.debug.fail_at == FailAt::kStep) {
      fail_on_purpose(c.debug, rank.rank, "at step " + std::to_string(step));
    }
    StepRecord r;
    r.step = step;
    r.lr = lr_at(t.optimizer, t.lr_schedule, step, t.steps);
    set_lr(*optimizer, r.lr);
    run_step(state, r);
    if (step == first_step) terms = memory_terms(par, params, buffers_before, setup_live_bytes, memory::live_bytes());
    comm = comm_bytes(rank);
    if (rank.cuda) {  // the step's kernels are done before it is timed
      rank.cuda->synchronize(device.index());
      r.device_peak_allocated_mb = static_cast<double>(rank.cuda->peak_allocated(device.index())) / (1 << 20);
      r.device_peak_reserved_mb = static_cast<double>(rank.cuda->peak_reserved(device.index())) / (1 << 20);
    }
    r.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    r.samples_per_s = static_cast<double>(t.global_batch) * 1000.0 / std::max(r.step_ms, 1e-9);
    if (data.inputs == InputKind::kTokens) r.tokens_per_s = r.samples_per_s * static_cast<double>(data.seq_len);
    r.peak_rss_mb = peak_rss_mb();
    step_peaks.push_back(memory::peak_bytes());
    r.peak_alloc_mb = static_cast<double>(step_peaks.back()) / (1 << 20);
    if (par.ac) r.recomputes = par.ac->recomputes() - recomputes_before;
    add_comm(rank, r);
    if (tcp_start >= 0) r.tcp_tx_bytes = tcp_tx_bytes() - tcp_start;
    if (metrics) metrics->record(r);
    result.steps.push_back(r);
    if (checkpoints && checkpointer.due(step)) checkpointer.save(step, held, *optimizer);
  }
  if (memory::counting() && !step_peaks.empty()) {  // every rank writes its counted tensor memory
    std::filesystem::create_directories(out_dir);
    write_json(out_dir + "/memory.rank" + std::to_string(rank.rank) + ".json",
               {{"rank", rank.rank},
                {"setup_live_bytes", setup_live_bytes},
                {"setup_peak_bytes", setup_peak_bytes},
                {"setup_peak_rss_mb", setup_peak_rss_mb},
                {"peak_bytes", *std::max_element(step_peaks.begin(), step_peaks.end())},
                {"step_peak_bytes", step_peaks},
                {"terms", {{"params", terms.params}, {"grads", terms.grads}, {"optimizer", terms.optimizer},
                           {"buffers", terms.buffers}}}});
  }
  if (rank.mesh && !step_peaks.empty()) {  // every rank writes the bytes its collectives moved in the last step
    std::filesystem::create_directories(out_dir);
    write_json(out_dir + "/comm.rank" + std::to_string(rank.rank) + ".json", {{"rank", rank.rank}, {"bytes", comm}});
  }
  if (par.pipe) {  // every rank writes the timeline of its last step
    nlohmann::json tl = nlohmann::json::array();
    for (const auto& e : par.pipe->timeline()) tl.push_back({{"action", e.action}, {"start_ms", e.start_ms}, {"end_ms", e.end_ms}});
    std::filesystem::create_directories(out_dir);
    write_json(out_dir + "/timeline.rank" + std::to_string(rank.rank) + ".json",
               {{"rank", rank.rank}, {"stages", par.pipe->local_stages()}, {"timeline", tl}});
  }
  if (!delays.empty()) {
    std::cout << rank.log_prefix << "debug.delay: slept " << delays.slept() << " times, " << delays.slept_ms()
              << " ms in all\n";
  }
  if (par.any) {
    write_final_weights(*model, par.placements.get(), par.world, rank.rank, out_dir + "/final.safetensors");
  } else if (rank.is_main()) {
    write_final_weights(*model, nullptr, nullptr, 0, out_dir + "/final.safetensors");
  }
  return result;
}

}  // namespace composer

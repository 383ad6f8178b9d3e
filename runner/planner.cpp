#include "runner/planner.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>

#include "models/registry.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/cuda_runtime.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/pipeline.h"
#include "parallelisms/tensor_parallel.h"

namespace composer {
namespace {

// Composition order: tensor parallel shards the math, activation checkpointing
// wraps the sharded blocks, data parallelism shards or replicates what remains,
// and the pipeline splits the result into stages.
int order_of(TransformKind k) {
  switch (k) {
    case TransformKind::kTensorParallel: return 0;
    case TransformKind::kActivationCheckpointing: return 1;
    case TransformKind::kFullyShard:
    case TransformKind::kReplicate: return 2;
    case TransformKind::kPipeline: return 3;
  }
  return 0;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

int64_t dim_size(const MeshConfig& m, const std::string& name) {
  for (size_t i = 0; i < m.names.size(); ++i) {
    if (m.names[i] == name) return m.shape[i];
  }
  return 0;
}

void check_mesh(const ExperimentConfig& c, int64_t world_size) {
  if (c.mesh.backend == Backend::kNccl && c.mesh.device != DeviceKind::kCuda) {
    throw PlanError(c.mesh.ref, "mesh.backend nccl moves CUDA tensors only, and mesh.device is cpu: set device: "
                                "cuda, or backend: gloo");
  }
  for (const auto& t : c.parallelize) {
    // NCCL matches point-to-point messages by order on one stream per pair of
    // ranks, both directions together: a schedule's activations one way and
    // gradients the other would wait on each other unless grouped, which
    // composer's schedules do not do yet. Over Gloo they match by tag.
    if (t.kind == TransformKind::kPipeline && c.mesh.backend == Backend::kNccl) {
      throw PlanError(t.ref, "pipeline over mesh.backend nccl is not supported yet (its sends and receives "
                             "would need NCCL grouping); set mesh.backend: gloo, which moves CUDA activations "
                             "through host copies");
    }
  }
  const int64_t product = c.mesh.world_size();
  if (product != world_size) {
    std::ostringstream os;
    os << "mesh.shape [" << c10::Join(", ", c.mesh.shape) << "] has " << product << " ranks but the job has "
       << world_size << "; make the product of mesh.shape equal the number of ranks";
    throw PlanError(c.mesh.ref, os.str());
  }
}

void check_order_and_dims(const ExperimentConfig& c) {
  int last_order = -1;
  std::string last_name;
  std::set<std::string> used;
  for (const auto& t : c.parallelize) {
    for (const auto& d : t.mesh_dim) {
      if (dim_size(c.mesh, d) == 0) {
        throw PlanError(t.ref, std::string(name_of(t.kind)) + " uses mesh dim '" + d + "' but mesh.names is [" +
                                   join(c.mesh.names) + "]; name one of those in mesh_dim or add the dim to the mesh");
      }
      if (!used.insert(d).second) {
        throw PlanError(t.ref, "mesh dim '" + d + "' is already used by an earlier transform; each dim serves one");
      }
    }
    if (order_of(t.kind) < last_order) {
      throw PlanError(t.ref, std::string(name_of(t.kind)) + " comes after " + last_name +
                                 "; transforms apply in the order tensor_parallel, activation_checkpointing, "
                                 "fully_shard or replicate, pipeline: reorder parallelize");
    }
    last_order = order_of(t.kind);
    last_name = name_of(t.kind);
  }
  for (size_t i = 0; i < c.mesh.names.size(); ++i) {
    if (c.mesh.shape[i] > 1 && !used.count(c.mesh.names[i])) {
      throw PlanError(c.mesh.ref, "mesh dim '" + c.mesh.names[i] + "' has " + std::to_string(c.mesh.shape[i]) +
                                      " ranks but no transform uses it; add a transform over it (e.g. replicate: "
                                      "{mesh_dim: " + c.mesh.names[i] + "}) or make it 1");
    }
  }
}

void check_supported(const ExperimentConfig& c) {
  for (const auto& t : c.parallelize) {
    if (t.kind == TransformKind::kFullyShard && &t != &c.parallelize.front()) {
      for (const auto& u : c.parallelize) {
        if (&u == &t) break;
        if (u.kind == TransformKind::kFullyShard) {
          throw PlanError(t.ref, "a second fully_shard would shard the shards again, which this version does not do; "
                                 "shard over one dim and replicate over the other (HSDP: fully_shard: {mesh_dim: [" +
                                     u.mesh_dim.front() + ", " + t.mesh_dim.front() + "]}, or a replicate transform)");
        }
      }
    }
    if (t.kind == TransformKind::kFullyShard && t.mesh_dim.size() > 2) {
      throw PlanError(t.ref, "fully_shard spans one mesh dim (FSDP) or two, [replicate, shard] (HSDP), not " +
                                 std::to_string(t.mesh_dim.size()));
    }
  }
  bool tp = false;
  for (const auto& t : c.parallelize) {
    tp = tp || t.kind == TransformKind::kTensorParallel;
    if (t.kind == TransformKind::kFullyShard && t.shard_placement == ShardPlacement::kOppositeTp && !tp) {
      throw PlanError(t.ref, "shard_placement: opposite_tp shards the dim tensor parallelism does not, but no "
                             "tensor_parallel comes before this fully_shard; use dim0 or add tensor_parallel");
    }
    if (t.kind == TransformKind::kFullyShard && t.all_gather != AllGather::kPlain &&
        c.train.dtype != DType::kFloat32) {
      throw PlanError(t.ref, "the all_gather extensions transform float32 parameters, but train.dtype is " +
                                 std::string(name_of(c.train.dtype)) + "; use all_gather: plain or dtype float32");
    }
  }
}

void plan_data_parallel(const ExperimentConfig& c, Plan& p) {
  for (const auto& t : c.parallelize) {
    if (t.kind == TransformKind::kReplicate || t.kind == TransformKind::kFullyShard) {
      for (const auto& d : t.mesh_dim) {
        p.dp_dims.push_back(d);
        p.dp_size *= dim_size(c.mesh, d);
      }
      if (t.mesh_dim.size() > 1) p.flat_groups.push_back(t.mesh_dim);
    }
  }
  // One group over every data-parallel dim: the data split and the loss.
  if (p.dp_dims.size() > 1 && std::find(p.flat_groups.begin(), p.flat_groups.end(), p.dp_dims) == p.flat_groups.end()) {
    p.flat_groups.push_back(p.dp_dims);
  }
  const int64_t per_step = p.dp_size * c.train.microbatches;
  if (c.train.global_batch % per_step != 0) {
    std::ostringstream os;
    os << "global_batch " << c.train.global_batch << " does not split over " << p.dp_size
       << " data-parallel ranks x " << c.train.microbatches << " microbatches (" << per_step
       << "); use a multiple of " << per_step;
    throw PlanError(SourceRef{c.file, 0, 0, "train.global_batch", ""}, os.str());
  }
  p.local_batch = c.train.global_batch / p.dp_size;
  p.local_microbatch = p.local_batch / c.train.microbatches;
}

// The model's modules, names and shapes (built on meta: planning needs no values).
models::ModelPtr model_structure(const ExperimentConfig& c) {
  nn::ShapeOnly shapes;
  return models::find_model(c.model.name)->build(c.model.args);
}

// fully_shard: every unit pattern must name a module; under a pipeline every
// parameter must be in a unit (a stage never runs the model's own forward,
// where the root unit would gather).
void plan_fully_shard(const ExperimentConfig& c) {
  bool pipeline = false;
  for (const auto& t : c.parallelize) pipeline = pipeline || t.kind == TransformKind::kPipeline;
  for (const auto& t : c.parallelize) {
    if (t.kind != TransformKind::kFullyShard) continue;
    models::ModelPtr model = model_structure(c);
    if (auto problem = parallel::check_units(*model, t.units)) throw PlanError(t.ref, *problem);
    if (!pipeline) continue;
    std::vector<std::string> unit_names;
    for (auto& [name, m] : nn::named_modules(*model)) {
      for (const auto& pattern : t.units) {
        if (!name.empty() && parallel::fqn_matches(pattern, name)) unit_names.push_back(name);
      }
    }
    for (auto& [fqn, p] : nn::unique_named_parameters(*model)) {
      bool covered = false;
      for (const auto& u : unit_names) covered = covered || fqn.rfind(u + ".", 0) == 0;
      if (!covered) {
        throw PlanError(t.ref, "with a pipeline every parameter must belong to a fully_shard unit (a stage never runs "
                               "the model's own forward), but " + fqn + " is in none; add a units pattern for it");
      }
    }
  }
}

// Activation checkpointing: every pattern names a module, the units do not
// nest, and no fully_shard unit lies inside one (its parameters would be
// gathered inside the no-grad forward, out of reach of the recompute, which
// computes with the parameters present when the unit's backward begins).
void plan_activation_checkpointing(const ExperimentConfig& c, Plan& p) {
  for (const auto& t : c.parallelize) {
    if (t.kind != TransformKind::kActivationCheckpointing) continue;
    models::ModelPtr model = model_structure(c);
    const parallel::ActivationCheckpointOptions o{t.units, t.every};
    if (auto problem = parallel::check_checkpoint_units(*model, o)) throw PlanError(t.ref, *problem);
    const auto units = parallel::checkpoint_units(*model, o);
    for (const auto& f : c.parallelize) {
      if (f.kind != TransformKind::kFullyShard) continue;
      for (const auto& [inner, m] : parallel::select_modules(*model, f.units)) {
        for (const auto& outer : units) {
          if (inner.rfind(outer + ".", 0) != 0) continue;
          throw PlanError(f.ref, "fully_shard unit " + inner + " lies inside the checkpointed unit " + outer +
                                     ", whose recompute computes with the parameters gathered before it; make the "
                                     "fully_shard units the checkpointed modules or modules that contain them "
                                     "(e.g. both units: [" + t.units.front() + "])");
        }
      }
    }
    std::string list;
    for (size_t i = 0; i < units.size(); ++i) list += (i ? ", " : "") + units[i];
    p.summary.push_back("activation_checkpointing: " + std::to_string(units.size()) + " units recompute their "
                        "forward in backward (" + list + ")");
  }
}

// Tensor parallelism: the model's plan must exist, suit the model's modules and
// divide what it shards (heads; the sequence under sequence parallelism).
void plan_tensor_parallel(const ExperimentConfig& c, Plan& p) {
  for (const auto& t : c.parallelize) {
    if (t.kind != TransformKind::kTensorParallel) continue;
    if (t.mesh_dim.size() != 1) throw PlanError(t.ref, "tensor_parallel spans exactly one mesh dim");
    p.tp_size = dim_size(c.mesh, t.mesh_dim[0]);
    const models::ModelSpec* spec = models::find_model(c.model.name);
    const bool custom = t.plan == "custom";
    if (!custom && !spec->tp_plan) {
      throw PlanError(t.ref, "model " + c.model.name + " has no tensor-parallel plan; models with one: "
                             "mlp_module, mlp_module_even, mlp_module_layers, mlp, mlp_stack, simple_model, "
                             "simple_model_uneven, transformer, llama; or give plan: custom with styles");
    }
    if (!custom && t.plan != "default") {
      throw PlanError(t.ref, "unknown tensor-parallel plan '" + t.plan + "' for model " + c.model.name +
                                 "; use default (with sequence_parallel true or false) or custom (with styles)");
    }
    try {  // a custom plan still needs the model's divisibility (heads), not its sequence-parallel support
      if (spec->tp_check) spec->tp_check(c.model.args, p.tp_size, custom ? false : t.sequence_parallel);
    } catch (const models::ArgError& e) {
      throw PlanError(t.ref, e.what());
    }
    p.tp_plan = custom ? t.styles : spec->tp_plan(c.model.args, t.sequence_parallel);
    models::ModelPtr model = model_structure(c);
    if (auto problem = parallel::check_tp_plan(*model, p.tp_plan)) {
      throw PlanError(t.ref, "the " + c.model.name + " tensor-parallel plan does not fit the model: " + *problem);
    }
    const auto in = model->input_spec();
    const int64_t seq = c.data.seq_len ? c.data.seq_len : in.max_seq_len;
    if (t.sequence_parallel && seq % p.tp_size != 0) {
      throw PlanError(t.ref, "sequence_parallel shards the sequence: tp degree " + std::to_string(p.tp_size) +
                                 " does not divide seq_len " + std::to_string(seq) +
                                 " (data.seq_len, or the model's max_seq_len); choose a seq_len that tp divides");
    }
  }
}

// Pipeline: the schedule runs on pp x virtual_stages stages with enough
// microbatches, the model splits as asked, and each rank's batch divides.
void plan_pipeline(const ExperimentConfig& c, Plan& p) {
  for (const auto& t : c.parallelize) {
    if (t.kind != TransformKind::kPipeline) continue;
    if (t.mesh_dim.size() != 1) throw PlanError(t.ref, "pipeline spans exactly one mesh dim");
    const int pp = static_cast<int>(dim_size(c.mesh, t.mesh_dim[0]));
    const auto kind = t.schedule;
    const int v = static_cast<int>(t.virtual_stages);
    // The pipeline's microbatches are the step's: train.microbatches (when > 1)
    // or the pipeline's own count, which must then agree.
    int m = static_cast<int>(t.microbatches);
    if (c.train.microbatches > 1) {
      if (m && m != c.train.microbatches) {
        throw PlanError(t.ref, "pipeline microbatches " + std::to_string(m) + " differ from train.microbatches " +
                                   std::to_string(c.train.microbatches) + "; they are the same split: give one");
      }
      m = static_cast<int>(c.train.microbatches);
    }
    if (!m) m = kind == parallel::ScheduleKind::kZbv ? 2 * pp : pp;
    if (auto why = parallel::check_shape(kind, parallel::shape_for(kind, pp, v, m))) {
      throw PlanError(t.ref, "schedule " + std::string(name_of(t.schedule)) + ": " + *why);
    }
    if (p.local_batch % m != 0) {
      throw PlanError(t.ref, "the " + std::to_string(p.local_batch) + " samples per data-parallel rank do not split into " +
                                 std::to_string(m) + " pipeline microbatches; make global_batch a multiple of " +
                                 std::to_string(m * p.dp_size));
    }
    models::ModelPtr model = model_structure(c);
    auto pieces = model->pipeline_pieces();
    if (pieces.empty()) {
      throw PlanError(t.ref, "model " + c.model.name + " cannot be split into pipeline stages; models that can: "
                             "mlp_module_layers, mlp_stack, mlp_seq, transformer, llama");
    }
    std::vector<std::pair<size_t, size_t>> ranges;
    if (auto why = parallel::split_stages(pieces, pp * v, t.split_points, t.layers_per_stage, ranges)) {
      throw PlanError(t.ref, *why);
    }
    p.pp_size = pp;
    p.pp_microbatches = m;
    if (t.scale_grads && c.train.loss.name == LossKind::kSum && m > 1) {
      p.warnings.push_back(t.ref.where() + ": loss: sum with the pipeline's scale_grads: true divides each "
                           "microbatch's gradient by the " + std::to_string(m) + " microbatches, so this trains on "
                           "1/" + std::to_string(m) + " of the summed loss's gradient, unlike one device; set "
                           "scale_grads: false to match it");
    }
  }
}

// per_rank: each data-parallel rank keeps its own copy of the selected
// parameters, trained on its own samples. That is what the seed's mixture of
// experts computes only when the copies differ on every rank that sees other
// samples (the transform spans every data-parallel dim) and each copy is whole
// on its rank and computes in the training dtype.
void plan_per_rank(const ExperimentConfig& c, Plan& p) {
  for (const auto& t : c.parallelize) {
    if (t.per_rank.empty()) continue;
    const std::string where = "per_rank";
    if (t.mesh_dim != p.dp_dims) {
      throw PlanError(t.per_rank_ref, where + " parameters differ on every rank that sees other samples, but this " +
                                          name_of(t.kind) + " spans [" + join(t.mesh_dim) + "] and data parallelism [" +
                                          join(p.dp_dims) + "]; give per_rank to one transform over every "
                                          "data-parallel dim (e.g. fully_shard: {mesh_dim: [" + join(p.dp_dims) + "]})");
    }
    for (const auto& u : c.parallelize) {
      if (u.kind == TransformKind::kTensorParallel || u.kind == TransformKind::kPipeline) {
        throw PlanError(t.per_rank_ref, where + " keeps each rank's copy whole and only on data-parallel ranks, "
                                        "but " + name_of(u.kind) + " (" + u.ref.where() + ") would split the model "
                                        "across ranks that must hold the same copy; this version does not combine "
                                        "them: drop per_rank or the " + name_of(u.kind) + " transform");
      }
    }
    if (t.param_dtype || t.all_gather != AllGather::kPlain) {
      throw PlanError(t.per_rank_ref, where + " parameters stay outside fully_shard and compute in the training "
                                      "dtype, but this fully_shard computes in " +
                                      (t.param_dtype ? std::string(name_of(*t.param_dtype)) : "rounded bfloat16") +
                                      "; drop param_dtype/all_gather or per_rank");
    }
    torch::manual_seed(c.seed);
    models::ModelPtr model = models::find_model(c.model.name)->build(c.model.args);
    std::vector<std::string> names;
    for (const auto& pattern : t.per_rank) {
      auto selected = parallel::per_rank_params(*model, {pattern});
      if (selected.empty()) {
        throw PlanError(t.per_rank_ref, where + " pattern '" + pattern + "' selects no parameter of " +
                                            c.model.name + "; give a module or parameter FQN, e.g. " +
                                            nn::unique_named_parameters(*model).back().first);
      }
      for (const auto& n : selected) {
        if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
      }
    }
    if (names.size() == nn::unique_named_parameters(*model).size()) {
      throw PlanError(t.per_rank_ref, where + " selects every parameter of " + c.model.name + ": nothing would be "
                                          "data parallel (each rank trains its own model); leave some parameters out");
    }
    p.summary.push_back("per_rank: " + join(names) + " keep their own values on each of the " +
                        std::to_string(p.dp_size) + " data-parallel ranks, neither sharded nor reduced" +
                        (t.per_rank_seed >= 0 ? " (rank i draws them with seed " + std::to_string(t.per_rank_seed) +
                                                    " + i)" : ""));
  }
}

}  // namespace

void check_devices(const ExperimentConfig& c, int64_t local_ranks) {
  if (c.mesh.device != DeviceKind::kCuda) return;
  std::string why;
  parallel::CudaRuntime* cuda = parallel::cuda_runtime(why);
  if (!cuda) throw PlanError(c.mesh.ref, "mesh.device cuda: " + why + "; set device: cpu");
  const int gpus = cuda->device_count();
  if (gpus == 0) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    throw PlanError(c.mesh.ref, std::string("mesh.device cuda, but no GPU is visible to this process (") +
                                    (visible ? "CUDA_VISIBLE_DEVICES=" + std::string(visible)
                                             : std::string("no CUDA driver or device found")) +
                                    "); set device: cpu, or run on a machine with a GPU");
  }
  // NCCL refuses two ranks on one GPU; over Gloo, ranks may share GPUs
  // (local rank r binds cuda:(r mod GPUs)), which is slow but exact.
  if (local_ranks > gpus && c.mesh.backend == Backend::kNccl) {
    throw PlanError(c.mesh.ref, "mesh.device cuda with backend nccl binds one GPU per local rank, but " +
                                    std::to_string(local_ranks) + " ranks run on this machine and it has " +
                                    std::to_string(gpus) + " GPU(s); spread the job over more nodes (--nnodes), "
                                    "make the mesh smaller, or set backend: gloo to let ranks share GPUs");
  }
}

Plan make_plan(const ExperimentConfig& c, int64_t world_size) {
  check_mesh(c, world_size);
  check_order_and_dims(c);
  check_supported(c);
  Plan p;
  p.world_size = world_size;
  p.transforms = c.parallelize;
  plan_data_parallel(c, p);
  plan_tensor_parallel(c, p);
  plan_fully_shard(c);
  plan_pipeline(c, p);
  std::ostringstream os;
  os << "model " << c.model.name << ", " << c.train.steps << " steps of " << c.train.global_batch << " samples ("
     << c.train.microbatches << " microbatch" << (c.train.microbatches > 1 ? "es" : "") << "), dtype "
     << name_of(c.train.dtype) << ", optimizer " << name_of(c.train.optimizer.name) << " lr " << c.train.optimizer.lr;
  p.summary.push_back(os.str());
  if (c.parallelize.empty()) {
    p.summary.push_back("world size 1, no parallel transforms (single device)");
  } else {
    p.summary.push_back("world size " + std::to_string(world_size) + ", data parallel over [" + join(p.dp_dims) +
                        "] (" + std::to_string(p.dp_size) + " ranks, " + std::to_string(p.local_batch) +
                        " samples each), tensor parallel degree " + std::to_string(p.tp_size));
    for (size_t i = 0; i < c.parallelize.size(); ++i) {
      p.summary.push_back("transform " + std::to_string(i) + ": " + name_of(c.parallelize[i].kind) + " over [" +
                          join(c.parallelize[i].mesh_dim) + "]");
    }
  }
  plan_activation_checkpointing(c, p);
  plan_per_rank(c, p);
  return p;
}

}  // namespace composer

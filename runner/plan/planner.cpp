#include "runner/plan/planner.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

#include "models/moe.h"
#include "models/registry.h"
#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/comm/cuda_runtime.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/pipeline/pipeline.h"
#include "parallelisms/parallelize.h"
#include "parallelisms/tensor_parallel.h"
#include "models/select.h"
#include "runner/plan/plan_debug.h"
#include "runner/plan/plan_fp8.h"
#include "runner/plan/plan_mesh.h"

namespace composer {
namespace {

using parallel::Overloaded;

// The data-parallel dims (every fully_shard and replicate dim, in order) and
// the batch each data-parallel rank gets.
// The dim context parallelism splits sequences over is not one: its ranks see
// the same samples, whatever else spans it.
void plan_data_parallel(const ExperimentConfig& c, Plan& p) {
  const std::string cp = context_parallel_dim(c);
  for (const auto& t : c.parallelize) {
    if (!data_parallel(t)) continue;
    for (const auto& d : t.mesh_dim()) {
      // cp's ranks hold the same samples; a dim fully_shard borrows from expert_parallel counts once.
      if (d == cp || std::find(p.dp_dims.begin(), p.dp_dims.end(), d) != p.dp_dims.end()) continue;
      p.dp_dims.push_back(d);
      p.dp_size *= dim_size(c.mesh, d);
    }
    if (t.mesh_dim().size() > 1) p.flat_groups.push_back(t.mesh_dim());
    if (const auto* fs = std::get_if<FullyShardConfig>(&t.options)) {  // a shard dim of flattened dims
      const auto shard = flat_dims({fs->mesh_dim.back()});
      if (shard.size() > 1 && shard != t.mesh_dim()) p.flat_groups.push_back(shard);
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
  p.microbatches = c.train.microbatches;  // a pipeline's rule resolves its own
  p.local_microbatch = p.local_batch / p.microbatches;
}

// What the pass over the transforms has seen so far: each transform is
// checked against the model (built once, shapes only) and the transforms
// before it, which apply before it.
struct Planning {
  const ExperimentConfig& c;
  Plan& p;
  models::Model& model;
  const TransformConfig* pipeline = nullptr;
  const TransformConfig* tensor_parallel = nullptr;
  const TransformConfig* context_parallel = nullptr;
  const TransformConfig* fully_shard = nullptr;
  const ActivationCheckpointingConfig* checkpointing = nullptr;
  int64_t tp_size = 1;  // the tensor-parallel degree (1 = none)
  int64_t cp_size = 1;  // the context-parallel degree (1 = none)
  std::vector<std::string> checkpointed;  // the checkpointed unit FQNs
  std::vector<std::string> summary;       // activation checkpointing's and per_rank's lines
};

// Pipeline: the schedule runs on pp x virtual_stages stages with enough
// microbatches, the model splits as asked, and each rank's batch divides.
// Over NCCL, which matches sends and receives by order on one stream per
// rank, every rank's grouped sequence is checked against NCCL's rules first
// (parallelisms/comm/p2p_check.h); over Gloo they match by tag.
void plan_one(Planning& s, const TransformConfig& entry, PipelineConfig& t) {
  const ExperimentConfig& c = s.c;
  Plan& p = s.p;
  if (t.mesh_dim.size() != 1) throw PlanError(entry.ref, "pipeline spans exactly one mesh dim");
  const int pp = static_cast<int>(dim_size(c.mesh, t.mesh_dim[0]));
  const auto kind = t.schedule;
  const int v = static_cast<int>(t.virtual_stages);
  // The pipeline's microbatches are the step's: train.microbatches (when > 1)
  // or the pipeline's own count, which must then agree.
  int m = static_cast<int>(t.microbatches);
  if (c.train.microbatches > 1) {
    if (m && m != c.train.microbatches) {
      throw PlanError(entry.ref, "pipeline microbatches " + std::to_string(m) + " differ from train.microbatches " +
                                     std::to_string(c.train.microbatches) + "; they are the same split: give one");
    }
    m = static_cast<int>(c.train.microbatches);
  }
  if (!m) m = parallel::v_schedule(kind) ? 2 * pp : pp;
  if (auto why = parallel::check_shape(kind, parallel::shape_for(kind, pp, v, m))) {
    throw PlanError(entry.ref, "schedule " + std::string(name_of(t.schedule)) + ": " + *why);
  }
  if (c.mesh.backend == Backend::kNccl) {
    const std::string why = parallel::check_schedule_p2p(kind, parallel::shape_for(kind, pp, v, m), parallel::P2POrder::kGrouped);
    if (!why.empty()) {
      throw PlanError(entry.ref, "schedule " + std::string(name_of(t.schedule)) + " on " + std::to_string(pp) + " ranks with " +
                                     std::to_string(m) + " microbatches could hang over NCCL (" + why +
                                     "); use another schedule or microbatch count, or set mesh.backend: gloo");
    }
  }
  if (p.local_batch % m != 0) {
    throw PlanError(entry.ref, "the " + std::to_string(p.local_batch) + " samples per data-parallel rank do not split into " +
                                   std::to_string(m) + " pipeline microbatches; make global_batch a multiple of " +
                                   std::to_string(m * p.dp_size));
  }
  auto pieces = s.model.pipeline_pieces();
  if (pieces.empty()) {
    throw PlanError(entry.ref, "model " + c.model.name + " cannot be split into pipeline stages; models that can: " +
                                   models::listed_names_with(models::Capability::kPipeline));
  }
  std::vector<std::pair<size_t, size_t>> ranges;
  if (auto why = parallel::split_stages(pieces, pp * v, t.split_points, t.layers_per_stage, ranges)) {
    throw PlanError(entry.ref, *why);
  }
  t.microbatches = m;
  t.loss_factor = parallel::pipeline_loss_factor(t.scale_grads, c.train.loss.name == LossKind::kSum, m);
  p.microbatches = m;
  p.local_microbatch = p.local_batch / m;
  s.pipeline = &entry;
  if (t.scale_grads && c.train.loss.name == LossKind::kSum && m > 1) {
    p.warnings.push_back(entry.ref.where() + ": loss: sum with the pipeline's scale_grads: true divides each "
                         "microbatch's gradient by the " + std::to_string(m) + " microbatches, so this trains on "
                         "1/" + std::to_string(m) + " of the summed loss's gradient, unlike one device; set "
                         "scale_grads: false to match it");
  }
}

// The sequence cuts as the transforms that split it need: into context
// parallelism's equal chunks, and each rank's slice over sequence-parallel ranks.
void check_sequence_split(const Planning& s) {
  const ExperimentConfig& c = s.c;
  const int64_t seq = c.data.seq_len ? c.data.seq_len : s.model.input_spec().max_seq_len;
  const std::string seq_from = "seq_len " + std::to_string(seq) + " (data.seq_len, or the model's max_seq_len)";
  int64_t local = seq;
  if (s.context_parallel) {
    const bool balance = s.context_parallel->get<ContextParallelConfig>()->load_balance;
    const int64_t pieces = parallel::chunks_per_sequence(static_cast<int>(s.cp_size), balance);
    if (seq % pieces != 0) {
      throw PlanError(s.context_parallel->ref,
                      "context_parallel cuts each sequence into " + std::to_string(pieces) + " equal chunks (" +
                          (balance ? "2 x cp " + std::to_string(s.cp_size) + " with load_balance"
                                   : "cp " + std::to_string(s.cp_size)) +
                          "), which do not divide " + seq_from + "; choose a seq_len that " + std::to_string(pieces) +
                          " divides");
    }
    local = seq / s.cp_size;
  }
  if (!s.tensor_parallel) return;
  const auto& tp = std::get<TensorParallelConfig>(s.tensor_parallel->options);
  if (tp.sequence_parallel && local % s.tp_size != 0) {
    throw PlanError(s.tensor_parallel->ref,
                    "sequence_parallel shards the sequence: tp degree " + std::to_string(s.tp_size) +
                        " does not divide " + (s.context_parallel ? "each context-parallel rank's " +
                                                                        std::to_string(local) + " tokens of " + seq_from
                                                                  : seq_from) +
                        "; choose a seq_len that tp" + (s.context_parallel ? " x cp" : "") + " divides");
  }
}

// Loss parallel: cross entropy on the logits module's vocabulary-sharded
// output. The default plan's rule for it then outputs shard(-1); a custom plan
// must say so itself.
void plan_loss_parallel(Planning& s, const TransformConfig& entry, TensorParallelConfig& t, const models::ModelSpec& spec,
                        bool custom) {
  const ExperimentConfig& c = s.c;
  if (c.train.loss.name != LossKind::kCrossEntropy) {
    throw PlanError(entry.ref, std::string("loss_parallel computes cross entropy on vocabulary-sharded logits, but "
                                           "train.loss is ") + name_of(c.train.loss.name) +
                                   "; use loss: {name: cross_entropy} or loss_parallel: false");
  }
  if (spec.logits.empty()) {
    throw PlanError(entry.ref, "model " + c.model.name + " has no vocabulary output for loss_parallel to shard "
                               "(models with one: " + models::listed_names_with(models::Capability::kLogits) +
                                   "); set loss_parallel: false");
  }
  models::TpRule* rule = nullptr;
  for (auto& r : t.rules) {
    if (models::fqn_matches(r.pattern, spec.logits)) rule = &r;
  }
  const bool fits = rule && rule->style == models::TpStyle::kColwise;
  if (!fits || (custom && !(rule->output.sharded && rule->output.dim == -1))) {
    throw PlanError(entry.ref, "loss_parallel keeps " + spec.logits + "'s logits sharded, so the plan needs a colwise "
                               "rule for " + spec.logits + " with output: shard(-1); add it to styles or set "
                               "loss_parallel: false");
  }
  rule->output = models::Layout::shard(-1);
  t.loss_module = spec.logits;
}

// Tensor parallelism: the model's plan must exist, suit the model's modules and
// divide what it shards (heads; the sequence under sequence parallelism).
void plan_one(Planning& s, const TransformConfig& entry, TensorParallelConfig& t) {
  const ExperimentConfig& c = s.c;
  Plan& p = s.p;
  if (t.mesh_dim.size() != 1) throw PlanError(entry.ref, "tensor_parallel spans exactly one mesh dim");
  s.tp_size = dim_size(c.mesh, t.mesh_dim[0]);
  const models::ModelSpec* spec = models::find_model(c.model.name);
  const bool custom = t.plan == "custom";
  if (!custom && !spec->tp_plan) {
    throw PlanError(entry.ref, "model " + c.model.name + " has no tensor-parallel plan; models with one: " +
                                   models::listed_names_with(models::Capability::kTpPlan) +
                                   "; or give plan: custom with styles");
  }
  if (!custom && t.plan != "default") {
    throw PlanError(entry.ref, "unknown tensor-parallel plan '" + t.plan + "' for model " + c.model.name +
                                   "; use default (with sequence_parallel true or false) or custom (with styles)");
  }
  try {  // a custom plan still needs the model's divisibility (heads), not its sequence-parallel support
    if (spec->tp_check) spec->tp_check(c.model.args, s.tp_size, custom ? false : t.sequence_parallel);
  } catch (const models::ArgError& e) {
    throw PlanError(entry.ref, e.what());
  }
  t.rules = custom ? t.styles : spec->tp_plan(c.model.args, t.sequence_parallel);
  if (auto problem = parallel::check_tp_plan(s.model, t.rules)) {
    throw PlanError(entry.ref, "the " + c.model.name + " tensor-parallel plan does not fit the model: " + *problem);
  }
  if (t.loss_parallel) plan_loss_parallel(s, entry, t, *spec, custom);
  s.tensor_parallel = &entry;
  check_sequence_split(s);
  p.splits_model = true;
}

// All-to-all context parallelism trades the sequence shard for a head shard:
// each rank's query and key/value heads (after tensor_parallel's split) must
// divide over cp.
void check_head_split(const Planning& s, const TransformConfig& entry) {
  const models::ModelArgs& a = s.c.model.args;
  if (!a.values().count("n_heads")) {
    throw PlanError(entry.ref, "context_parallel rotate alltoall splits the attention heads over cp, but model " +
                                   s.c.model.name + " has no n_heads; use rotate: ring or allgather");
  }
  const int64_t heads = a.i("n_heads");
  const int64_t kv = a.values().count("n_kv_heads") && a.i("n_kv_heads") > 0 ? a.i("n_kv_heads") : heads;
  const int64_t q_local = heads / s.tp_size, kv_local = kv / s.tp_size;
  if (q_local % s.cp_size == 0 && kv_local % s.cp_size == 0) return;
  throw PlanError(entry.ref, "context_parallel rotate alltoall splits each rank's attention heads over cp " +
                                 std::to_string(s.cp_size) + ", but a rank holds " + std::to_string(q_local) +
                                 " query and " + std::to_string(kv_local) + " key/value heads" +
                                 (s.tp_size > 1 ? " (after tensor_parallel over " + std::to_string(s.tp_size) + ")" : "") +
                                 "; use a cp that divides both, or rotate: ring or allgather");
}

// Context parallelism: the model's attention can be split, its samples are
// sequences that cut into equal chunks, and the loss is a mean over tokens
// (each rank's is the mean over its tokens; averaging over cp gives the whole).
void plan_one(Planning& s, const TransformConfig& entry, ContextParallelConfig& t) {
  const ExperimentConfig& c = s.c;
  if (t.mesh_dim.size() != 1) throw PlanError(entry.ref, "context_parallel spans exactly one mesh dim");
  s.cp_size = dim_size(c.mesh, t.mesh_dim[0]);
  const models::ModelSpec* spec = models::find_model(c.model.name);
  if (!spec->cp_check || !s.model.sequence_slot()) {
    throw PlanError(entry.ref, "model " + c.model.name + " has no attention context_parallel can split over the "
                               "sequence; models that have: " +
                                   models::listed_names_with(models::Capability::kContextParallel));
  }
  try {
    spec->cp_check(c.model.args);
  } catch (const models::ArgError& e) {
    throw PlanError(entry.ref, e.what());
  }
  if (t.rotate == parallel::Rotate::kAllToAll) check_head_split(s, entry);
  if (!s.model.input_spec().tokens || (c.data.inputs != InputKind::kAuto && c.data.inputs != InputKind::kTokens)) {
    throw PlanError(entry.ref, "context_parallel splits samples along the sequence, but data.inputs is " +
                                   std::string(name_of(c.data.inputs)) + ", not token sequences; use data.inputs: "
                                   "tokens (or auto)");
  }
  if (c.train.loss.name == LossKind::kSum) {
    throw PlanError(entry.ref, "context_parallel averages each rank's gradient over cp, which matches a mean over "
                               "tokens, but train.loss is sum; use cross_entropy or mean");
  }
  s.context_parallel = &entry;
  check_sequence_split(s);
}

// Activation checkpointing: every pattern names a module and the units do not nest.
void plan_one(Planning& s, const TransformConfig& entry, ActivationCheckpointingConfig& t) {
  if (auto problem = parallel::check_checkpoint_units(s.model, t)) throw PlanError(entry.ref, *problem);
  s.checkpointed = parallel::checkpoint_units(s.model, t);
  s.checkpointing = &t;
  s.summary.push_back("activation_checkpointing: " + std::to_string(s.checkpointed.size()) + " units recompute "
                      "their forward in backward (" + join(s.checkpointed) + ")");
}

// per_rank: each data-parallel rank keeps its own copy of the selected
// parameters, trained on its own samples. That is what the seed's mixture of
// experts computes only when the copies differ on every rank that sees other
// samples (the transform spans every data-parallel dim) and each copy is whole
// on its rank and computes in the training dtype.
template <class T>
void plan_per_rank(Planning& s, const TransformConfig& entry, const T& t, bool mixed_precision,
                   const std::string& precision) {
  if (t.per_rank.empty()) return;
  const ExperimentConfig& c = s.c;
  Plan& p = s.p;
  const std::string where = "per_rank";
  if (t.mesh_dim != p.dp_dims) {
    throw PlanError(entry.ref_of("per_rank"), where + " parameters differ on every rank that sees other samples, but this " +
                                        entry.name() + " spans [" + join(t.mesh_dim) + "] and data parallelism [" +
                                        join(p.dp_dims) + "]; give per_rank to one transform over every "
                                        "data-parallel dim (e.g. fully_shard: {mesh_dim: [" + join(p.dp_dims) + "]})");
  }
  for (const TransformConfig* u : {s.pipeline, s.tensor_parallel}) {
    if (!u) continue;
    throw PlanError(entry.ref_of("per_rank"), where + " keeps each rank's copy whole and only on data-parallel ranks, "
                                    "but " + u->name() + " (" + u->ref.where() + ") would split the model "
                                    "across ranks that must hold the same copy; this version does not combine "
                                    "them: drop per_rank or the " + u->name() + " transform");
  }
  if (mixed_precision) {
    throw PlanError(entry.ref_of("per_rank"), where + " parameters stay outside fully_shard and compute in the training "
                                    "dtype, but this fully_shard computes in " + precision +
                                    "; drop param_dtype/all_gather or per_rank");
  }
  std::vector<std::string> names;
  for (const auto& pattern : t.per_rank) {
    auto selected = parallel::per_rank_params(s.model, {pattern});
    if (selected.empty()) {
      throw PlanError(entry.ref_of("per_rank"), where + " pattern '" + pattern + "' selects no parameter of " + c.model.name +
                                          "; give a module or parameter FQN, e.g. " +
                                          nn::unique_named_parameters(s.model).back().first);
    }
    for (const auto& n : selected) {
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    }
  }
  if (names.size() == nn::unique_named_parameters(s.model).size()) {
    throw PlanError(entry.ref_of("per_rank"), where + " selects every parameter of " + c.model.name + ": nothing would be "
                                        "data parallel (each rank trains its own model); leave some parameters out");
  }
  p.per_rank = Plan::PerRank{t.per_rank, t.per_rank_seed, t.mesh_dim};
  s.summary.push_back("per_rank: " + join(names) + " keep their own values on each of the " +
                      std::to_string(p.dp_size) + " data-parallel ranks, neither sharded nor reduced" +
                      (t.per_rank_seed >= 0 ? " (rank i draws them with seed " + std::to_string(t.per_rank_seed) +
                                                  " + i)" : ""));
}

// fully_shard: one per plan (HSDP spans two dims), its options suit the
// training dtype and the transforms before it, every unit pattern names a
// module, no unit lies inside a checkpointed one (its parameters would be
// gathered inside the no-grad forward, out of reach of the recompute, which
// computes with the parameters present when the unit's backward begins), and
// under a pipeline every parameter is in a unit.
void plan_one(Planning& s, const TransformConfig& entry, FullyShardConfig& t) {
  const ExperimentConfig& c = s.c;
  if (s.fully_shard) {
    throw PlanError(entry.ref, "a second fully_shard would shard the shards again, which this version does not do; "
                               "shard over one dim and replicate over the other (HSDP: fully_shard: {mesh_dim: [" +
                                   s.fully_shard->mesh_dim().front() + ", " + t.mesh_dim.front() +
                                   "]}, or a replicate transform)");
  }
  if (t.mesh_dim.size() > 2) {
    throw PlanError(entry.ref, "fully_shard spans one mesh dim (FSDP) or two, [replicate, shard] (HSDP), not " +
                                   std::to_string(t.mesh_dim.size()));
  }
  if (t.shard_placement == ShardPlacement::kOppositeTp && !s.tensor_parallel) {
    throw PlanError(entry.ref, "shard_placement: opposite_tp shards the dim tensor parallelism does not, but no "
                               "tensor_parallel comes before this fully_shard; use dim0 or add tensor_parallel");
  }
  if (t.reshard_after_forward.size > 1) {
    int64_t shard = 1;
    for (const auto& d : flat_dims({t.mesh_dim.back()})) shard *= dim_size(c.mesh, d);
    if (shard % t.reshard_after_forward.size != 0) {
      throw PlanError(entry.ref_of("reshard_after_forward"), "reshard_after_forward: " + std::to_string(t.reshard_after_forward.size) +
                                         " must divide the shard dim " + t.mesh_dim.back() + " of " +
                                         std::to_string(shard) + " ranks (the group resharded to is that many "
                                         "consecutive ranks of it); use a divisor of " + std::to_string(shard) +
                                         ", true or false");
    }
  }
  if (t.all_gather != AllGather::kPlain && c.train.dtype != DType::kFloat32) {
    throw PlanError(entry.ref, "the all_gather extensions transform float32 parameters, but train.dtype is " +
                                   std::string(name_of(c.train.dtype)) + "; use all_gather: plain or dtype float32");
  }
  if (auto problem = parallel::check_units(s.model, t.units)) throw PlanError(entry.ref, *problem);
  const auto units = models::select_modules(s.model, t.units);
  for (const auto& [inner, m] : units) {
    for (const auto& outer : s.checkpointed) {
      if (inner.rfind(outer + ".", 0) != 0) continue;
      throw PlanError(entry.ref, "fully_shard unit " + inner + " lies inside the checkpointed unit " + outer +
                                     ", whose recompute computes with the parameters gathered before it; make the "
                                     "fully_shard units the checkpointed modules or modules that contain them "
                                     "(e.g. both units: [" + s.checkpointing->units.front() + "])");
    }
  }
  if (s.pipeline) {
    for (auto& [fqn, p] : nn::unique_named_parameters(s.model)) {
      bool covered = false;
      for (const auto& [u, m] : units) covered = covered || fqn.rfind(u + ".", 0) == 0;
      if (!covered) {
        throw PlanError(entry.ref, "with a pipeline every parameter must belong to a fully_shard unit, but " + fqn +
                                       " is in none; add a units pattern for it");
      }
    }
  }
  s.fully_shard = &entry;
  s.p.splits_model = true;
  plan_per_rank(s, entry, t, t.param_dtype || t.all_gather != AllGather::kPlain,
                t.param_dtype ? std::string(name_of(*t.param_dtype)) : "rounded bfloat16");
}

void plan_one(Planning& s, const TransformConfig& entry, ReplicateConfig& t) {
  plan_per_rank(s, entry, t, false, "");
}

// Expert parallelism: the model has routed experts, and they split evenly
// over the dim.
void plan_one(Planning& s, const TransformConfig& entry, ExpertParallelConfig& t) {
  const ExperimentConfig& c = s.c;
  if (t.mesh_dim.size() != 1) throw PlanError(entry.ref, "expert_parallel spans exactly one mesh dim");
  const models::ModelSpec* spec = models::find_model(c.model.name);
  const int64_t experts = spec->experts ? spec->experts(c.model.args) : 0;
  if (experts == 0) {
    throw PlanError(entry.ref, "model " + c.model.name + " has no routed experts to spread" +
                                   (spec->experts ? " (model.args.n_experts is 0); set n_experts" : "") +
                                   "; models that can have them: " +
                                   models::listed_names_with(models::Capability::kExperts) +
                                   ", or remove expert_parallel");
  }
  const int64_t ep = dim_size(c.mesh, t.mesh_dim[0]);
  if (experts % ep != 0) {
    throw PlanError(entry.ref, "expert_parallel over " + t.mesh_dim[0] + " (" + std::to_string(ep) + " ranks) needs " +
                                   "model.args.n_experts " + std::to_string(experts) + " to split evenly; use an " +
                                   "n_experts divisible by " + std::to_string(ep) + " or a dim whose size divides " +
                                   std::to_string(experts));
  }
  s.p.splits_model = true;
  s.summary.push_back("expert_parallel: " + std::to_string(experts / ep) + " of " + std::to_string(experts) +
                      " experts per rank over " + t.mesh_dim[0] + "; tokens travel by all-to-all");
  // What a block's dispatch holds on a rank, for a microbatch: the rows it
  // receives, under uniform routing (the dry run's, in the memory table) and
  // when every row of the ep ranks goes to its experts.
  const auto blocks = models::moe_blocks(s.model);
  if (blocks.empty()) return;
  const models::MoE* moe = blocks.front();
  const std::string cp_dim = context_parallel_dim(c);
  const int64_t seq = (c.data.seq_len ? c.data.seq_len : s.model.input_spec().max_seq_len) /
                      (cp_dim.empty() ? 1 : dim_size(c.mesh, cp_dim));
  const int64_t rows = s.p.local_microbatch * seq * moe->args().top_k;
  const int64_t row_bytes = moe->router->in_features * static_cast<int64_t>(c10::elementSize(scalar_type_of(c.train.dtype)));
  auto mib = [](int64_t bytes) {
    std::ostringstream os;
    os.precision(3);
    os << static_cast<double>(bytes) / (1 << 20) << " MiB";
    return os.str();
  };
  s.summary.push_back("expert_parallel dispatch per block and microbatch: " + std::to_string(rows) +
                      " rows received under uniform routing (" + mib(rows * row_bytes) + "), up to " +
                      std::to_string(rows * ep) + " (" + mib(rows * ep * row_bytes) + ") on a rank every row is "
                      "routed to; each received row also keeps its expert's activations for backward");
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
                                    "); set device: cpu, or run on a machine with a GPU (composer plan plans a cuda job without "
                                    "one when mesh.memory_per_rank_mb gives each GPU's memory)");
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

std::vector<parallel::Transform> Plan::steps() const {
  std::vector<parallel::Transform> out;
  for (const auto& t : transforms) out.push_back(t.options);
  return out;
}

std::vector<int> stage_first_ranks(const ExperimentConfig& c, const Plan& plan) {
  std::vector<int> ranks{0};
  const auto* pipeline = plan.find<PipelineConfig>();
  if (!pipeline) return ranks;
  const auto& names = c.mesh.names;
  const size_t d = std::find(names.begin(), names.end(), pipeline->mesh_dim.front()) - names.begin();
  int64_t stride = 1;
  for (size_t i = d + 1; i < names.size(); ++i) stride *= c.mesh.shape[i];
  for (int64_t s = 1; s < c.mesh.shape[d]; ++s) ranks.push_back(static_cast<int>(s * stride));
  return ranks;
}

namespace {

// Eval's own batch and sequence: the same plan must take them, which planning
// the training with them tells (the divisibility of the batch over dp ranks
// and microbatches, the sequence's over context and sequence parallelism).
void plan_eval(const ExperimentConfig& c, Plan& p, int64_t world_size, const models::InputSpec& input) {
  p.eval_local_batch = p.local_batch;
  p.eval_local_microbatch = p.local_microbatch;
  if (c.eval.every == 0 || (!c.eval.global_batch && !c.eval.seq_len)) return;
  const SourceRef& ref = c.eval.global_batch ? c.eval.global_batch_ref : c.eval.seq_len_ref;
  if (p.find<PipelineConfig>()) {
    throw PlanError(ref, "a pipeline's stage shapes (the receives each stage allocates) are fixed by the training "
                         "microbatch, so eval runs with training's batch and seq_len; remove eval.global_batch and "
                         "eval.seq_len");
  }
  ExperimentConfig e = c;
  e.eval = EvalConfig();
  if (c.eval.global_batch) e.train.global_batch = c.eval.global_batch;
  if (c.eval.seq_len) e.data.seq_len = c.eval.seq_len;
  if (c.eval.seq_len && input.tokens && c.eval.seq_len > input.max_seq_len) {
    throw PlanError(c.eval.seq_len_ref, "eval.seq_len " + std::to_string(c.eval.seq_len) + " exceeds the model's "
                                        "max_seq_len " + std::to_string(input.max_seq_len));
  }
  if (c.eval.seq_len && !input.tokens) {
    throw PlanError(c.eval.seq_len_ref, "eval.seq_len sets the tokens of a sample; model " + c.model.name +
                                        " takes float features; remove it");
  }
  try {
    const Plan q = make_plan(e, world_size);
    p.eval_local_batch = q.local_batch;
    p.eval_local_microbatch = q.local_microbatch;
  } catch (const UserError& err) {
    // One place, eval's key: the transform that refuses is named by its YAML path, not a second file:line.
    std::string why = err.what();
    if (const auto* pe = dynamic_cast<const PlanError*>(&err)) {
      why = (pe->ref().path.empty() ? "" : pe->ref().path + " refuses them: ") + pe->message();
    } else if (const auto* ce = dynamic_cast<const ConfigError*>(&err)) {
      why = (ce->ref().path.empty() ? "" : ce->ref().path + " refuses them: ") + ce->message();
    }
    throw PlanError(ref, std::string("eval.global_batch ") + std::to_string(e.train.global_batch) + " and seq_len " +
                             std::to_string(e.data.seq_len) + " do not fit this plan: " + why);
  }
}

}  // namespace

Plan make_plan(const ExperimentConfig& c, int64_t world_size) {
  check_mesh(c, world_size);
  check_order_and_dims(c);
  Plan p;
  p.world_size = world_size;
  p.transforms = c.parallelize;
  plan_data_parallel(c, p);
  models::ModelPtr model;
  {
    nn::ShapeOnly shapes;  // planning needs names and shapes, no values (and no random draws)
    model = models::find_model(c.model.name)->build(c.model.args);
  }
  check_inject_module(c, *model);
  Planning s{c, p, *model};
  for (auto& t : p.transforms) {
    std::visit([&](auto& o) { plan_one(s, t, o); }, t.options);
  }
  p.splits_model = p.splits_model || p.find<PipelineConfig>();
  const int64_t seq = c.data.seq_len ? c.data.seq_len : model->input_spec().max_seq_len;
  const std::string fp8 = plan_fp8(c, *model, p.local_microbatch * std::max<int64_t>(1, seq / s.cp_size), s.tp_size,
                                   p.dp_size, p.microbatches);
  if (!fp8.empty()) s.summary.push_back(fp8);
  std::ostringstream os;
  os << "model " << c.model.name << ", " << c.train.steps << " steps of " << c.train.global_batch << " samples ("
     << c.train.microbatches << " microbatch" << (c.train.microbatches > 1 ? "es" : "") << "), dtype "
     << name_of(c.train.dtype) << ", optimizer " << name_of(c.train.optimizer.name) << " lr " << c.train.optimizer.lr;
  if (c.train.optimizer.name == OptimizerKind::kMuon) {
    const MuonConfig m = c.train.optimizer.muon_or_default();
    os << " (AdamW's; Muon's matrices lr " << c.train.optimizer.muon_lr() << ", " << name_of(m.ns_dtype)
       << " iterations)";
  }
  p.summary.push_back(os.str());
  if (c.parallelize.empty()) {
    p.summary.push_back("world size 1, no parallel transforms (single device)");
  } else {
    p.summary.push_back("world size " + std::to_string(world_size) + ", data parallel over [" + join(p.dp_dims) +
                        "] (" + std::to_string(p.dp_size) + " ranks, " + std::to_string(p.local_batch) +
                        " samples each), tensor parallel degree " + std::to_string(s.tp_size) +
                        (s.cp_size > 1 ? ", context parallel degree " + std::to_string(s.cp_size) + " (each rank " +
                                             "holds 1/" + std::to_string(s.cp_size) + " of every sequence)"
                                       : ""));
    for (size_t i = 0; i < c.parallelize.size(); ++i) {
      const auto dims = c.parallelize[i].mesh_dim();
      p.summary.push_back("transform " + std::to_string(i) + ": " + c.parallelize[i].name() +
                          (dims.empty() ? "" : " over [" + join(dims) + "]"));
    }
  }
  p.summary.insert(p.summary.end(), s.summary.begin(), s.summary.end());
  plan_eval(c, p, world_size, model->input_spec());
  return p;
}

}  // namespace composer

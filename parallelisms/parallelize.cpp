#include "parallelisms/parallelize.h"

#include <sstream>

#include "models/layers.h"

namespace composer::parallel {
namespace {

// "over dp (2 ranks)"
std::string over(const Group* g) {
  return g ? "over " + g->name + " (" + std::to_string(g->size) + " rank" + (g->size == 1 ? "" : "s") + ")" : "";
}

// fully_shard's shard dim per parameter under shard_opposite: the dim that an
// earlier transform's Shard placement does not split (PyTorch's
// shard_placement_fn over tensor-parallel shards), else dim 0.
std::function<int64_t(const torch::Tensor&)> opposite_dim(const Placements* placements) {
  return [placements](const torch::Tensor& p) -> int64_t {
    const ShardSpec* spec = placements->find(p);
    if (!spec) return 0;
    for (const auto& d : spec->dims) {
      if (d.param.is_shard()) return p.dim() - 1 - d.param.dim;
    }
    return 0;
  };
}

// The stage shapes: the pipeline's trace on a shape-only copy of the model,
// cut the same way with every stage held and tensor-parallel like this rank
// (every stage's owner shares this rank's tensor-parallel coordinate), on this
// rank's context-parallel slice of the sequence: the later transforms that
// change an activation's shape.
StageShapes trace_stages(const PipelineStep& cut, const Transform* later, const Transform* end,
                         const ParallelizeOptions& o) {
  models::ModelPtr copy = o.shape_copy();
  copy->eval();
  PipelineOptions po = cut.options;
  po.every_stage = true;
  po.placements = nullptr;
  Pipeline twin(*copy, *cut.group, po);
  Placements scratch;
  std::vector<std::unique_ptr<TensorParallel>> keep;
  torch::Tensor example = o.example.to(torch::kMeta);
  for (const Transform* t = later; t != end; ++t) {
    std::visit(Overloaded{[&](const TensorParallelStep& tp) {
                            keep.push_back(apply_tensor_parallel(twin.roots(), *tp.group, tp.plan, scratch));
                          },
                          [&](const ContextParallelStep& cp) {
                            example = ContextParallel(*cp.group, cp.options).slice(example, 1);
                          },
                          [](const auto&) {}},  // the others change no activation's shape or dtype at a stage's edge
               *t);
  }
  return twin.trace(example);
}

// A data-parallel transform over the context-parallel dim (FSDP sharding over
// the ranks that split the sequence, as torchtitan's dp_shard_cp): its
// placement there, whose gradient is averaged over cp too, takes the place of
// context parallelism's Replicate / Partial(avg).
void take_over_cp(Parallel& par, const Group* spanned) {
  if (!par.cp || !spanned) return;
  const std::string& cp = par.cp->group().name;
  std::string names = spanned->name;
  for (size_t at = 0; at <= names.size();) {
    const size_t end = std::min(names.find('+', at), names.size());
    if (names.compare(at, end - at, cp) == 0 && end - at == cp.size()) {
      par.placements->drop(cp);
      return;
    }
    at = end + 1;
  }
}

}  // namespace

const char* name_of(const Transform& t) {
  return std::visit(
      Overloaded{[](const PipelineStep&) { return "pipeline"; },
                 [](const TensorParallelStep&) { return "tensor_parallel"; },
                 [](const ContextParallelStep&) { return "context_parallel"; },
                 [](const ActivationCheckpointingStep&) { return "activation_checkpointing"; },
                 [](const FullyShardStep&) { return "fully_shard"; }, [](const ReplicateStep&) { return "replicate"; }},
      t);
}

std::vector<torch::Tensor> Parallel::held_params() const {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : models::root_parameters(roots)) out.push_back(p);
  return out;
}

void Parallel::set_requires_sync(bool on) {
  if (sync) sync->set_requires_sync(on);
  if (fsdp) fsdp->set_requires_sync(on);
}

void Parallel::reshard() {
  if (fsdp) fsdp->reshard();
}

void Parallel::finish_grad_sync() {
  if (fsdp) fsdp->flush();  // unit reduce-scatters held back while sync was off (a pipeline step)
  if (sync) sync->finish();
}

void Parallel::derive_grad_sync() {
  if (any) sync = std::make_unique<GradSync>(held_params(), *placements, GradSyncOptions{bucket_mb});
}

int64_t Parallel::buffer_bytes() const { return (fsdp ? fsdp->pooled_bytes() : 0) + (sync ? sync->buffer_bytes() : 0); }

namespace {

// One transform being applied: the model, what earlier transforms left, and
// the transforms after it (the pipeline traces the stage shapes with them).
// Each apply() returns whether the transform spreads the model over ranks.
struct Applying {
  models::Model& model;
  Parallel& par;
  const ParallelizeOptions& o;
  const Transform* later;  // the transforms after this one, up to `end`
  const Transform* end;
  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }
};

bool apply(Applying& a, const PipelineStep& s) {
  Parallel& par = a.par;
  PipelineOptions po = s.options;
  po.placements = par.placements.get();
  par.pipe = std::make_unique<Pipeline>(a.model, *s.group, po);
  par.roots = par.pipe->roots();
  if (a.o.example.defined() && a.o.shape_copy) par.pipe->set_shapes(trace_stages(s, a.later, a.end, a.o));
  std::string stages;
  for (int st : par.pipe->local_stages()) stages += (stages.empty() ? "" : ", ") + std::to_string(st);
  a.log("applied pipeline " + over(s.group) + ": " + name_of(s.options.schedule) + ", " +
        std::to_string(par.pipe->shape().stages()) + " stages, this rank runs stage" +
        (par.roots.size() == 1 ? " " : "s ") + stages);
  return true;
}

bool apply(Applying& a, const TensorParallelStep& s) {
  a.par.tp = apply_tensor_parallel(a.par.roots, *s.group, s.plan, *a.par.placements);
  for (const auto& root : a.par.roots) {  // a pipeline rank without the logits computes no loss
    for (const auto& [name, m] : root.modules) {
      auto* out = name == s.loss_parallel ? dynamic_cast<nn::Linear*>(m) : nullptr;
      if (out) a.par.vocab = {s.group, out->out_features};
    }
  }
  a.log("applied tensor_parallel " + over(s.group) + ": " + std::to_string(a.par.tp->num_modules()) + " modules");
  return true;
}

bool apply(Applying& a, const ContextParallelStep& s) {
  a.par.cp = apply_context_parallel(a.model, a.par.roots, *s.group, s.options, *a.par.placements);
  a.log("applied context_parallel " + over(s.group) + ": " + name_of(s.options.rotate) + " attention, " +
        (s.options.load_balance ? "load-balanced chunks" : "contiguous slices"));
  return true;
}

bool apply(Applying& a, const ActivationCheckpointingStep& s) {
  a.par.ac = apply_activation_checkpointing(a.par.roots, s.options);
  a.log("applied activation_checkpointing: " + std::to_string(a.par.ac->units().size()) + " units");
  return false;  // how a unit computes, not where
}

bool apply(Applying& a, const FullyShardStep& s) {
  Parallel& par = a.par;
  FullyShardOptions fo = s.options;
  fo.placements = par.placements.get();
  if (s.shard_opposite) fo.shard_dim = opposite_dim(par.placements.get());
  if (!fo.per_rank.empty()) par.per_rank = apply_per_rank(par.roots, *s.data_parallel, fo.per_rank, *par.placements);
  take_over_cp(par, s.data_parallel);
  par.fsdp = apply_fully_shard(par.roots, *s.group, fo);
  a.log("applied fully_shard " + over(s.data_parallel) + ": " + std::to_string(par.fsdp->num_units()) + " units");
  return true;
}

bool apply(Applying& a, const ReplicateStep& s) {
  Parallel& par = a.par;
  if (!s.options.per_rank.empty()) {
    par.per_rank = apply_per_rank(par.roots, *s.group, s.options.per_rank, *par.placements);
  }
  take_over_cp(par, s.group);
  apply_replicate(par.roots, *s.group, s.options, *par.placements);
  par.bucket_mb = s.options.bucket_mb;
  std::ostringstream mb;
  mb << par.bucket_mb;
  a.log("applied replicate " + over(s.group) + ": gradients all-reduced in buckets of " + mb.str() + " MB");
  return true;
}

}  // namespace

Parallel parallelize(models::Model& model, const std::vector<Transform>& transforms, const ParallelizeOptions& o) {
  Parallel par;
  par.roots = {models::whole(model)};
  par.world = o.world;
  par.dp = o.data_parallel;
  for (size_t i = 0; i < transforms.size(); ++i) {
    Applying a{model, par, o, transforms.data() + i + 1, transforms.data() + transforms.size()};
    const bool spreads = std::visit([&](const auto& step) { return apply(a, step); }, transforms[i]);
    par.any = par.any || spreads;
  }
  // Activation checkpointing alone changes how a unit computes, not where:
  // nothing is spread over ranks and nothing needs synchronising.
  if (!par.any) par.world = par.dp = nullptr;
  return par;
}

}  // namespace composer::parallel

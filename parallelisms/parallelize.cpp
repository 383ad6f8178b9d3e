#include "parallelisms/parallelize.h"

namespace composer::parallel {

std::string over(const Group* g) {
  return g ? "over " + g->name + " (" + std::to_string(g->size) + " rank" + (g->size == 1 ? "" : "s") + ")" : "";
}

Group& Applying::group(const std::vector<std::string>& dims) const {
  TORCH_INTERNAL_ASSERT(o.mesh, "a transform was applied without a device mesh");
  return o.mesh->group(flat_dims(dims));
}

Group& Tracing::group(const std::vector<std::string>& dims) const {
  TORCH_INTERNAL_ASSERT(o.mesh, "a transform was traced without a device mesh");
  return o.mesh->group(flat_dims(dims));
}

Parallel::Parallel() = default;
Parallel::Parallel(Parallel&&) noexcept = default;
Parallel& Parallel::operator=(Parallel&&) noexcept = default;
Parallel::~Parallel() = default;

torch::Tensor Parallel::sequence_slice(const torch::Tensor& t) const { return cp ? cp->slice(t, 1) : t; }

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
  torch::NoGradGuard no_grad;
  for (auto& [p, factor] : grad_factors) {
    if (p.grad().defined()) p.mutable_grad().mul_(factor);
  }
}

void Parallel::derive_grad_sync() {
  if (any) sync = std::make_unique<GradSync>(held_params(), *placements, GradSyncOptions{bucket_mb});
}

int64_t Parallel::buffer_bytes() const { return (fsdp ? fsdp->pooled_bytes() : 0) + (sync ? sync->buffer_bytes() : 0); }

void Parallel::take_over_cp(const Group& spanned) {
  if (!cp) return;
  const std::string& name = cp->group().name;
  const std::vector<std::string> spans = flat_dims({spanned.name});
  if (std::find(spans.begin(), spans.end(), name) == spans.end()) return;
  // A parameter an earlier transform split over another of the dims spanned (expert_parallel's experts over
  // the dim fully_shard borrows) stays that transform's: its gradient is averaged over cp as before
  // (context parallelism's own dim never splits a parameter).
  placements->drop_unless(name, [&](const ShardSpec& spec) { return spec.split_over(spans); });
}

namespace {

// Buffers (a router's expert bias, BatchNorm's statistics) are whole wherever
// they are held: Replicate on every mesh dim a transform did not place them
// on (a pipeline places them on its stages' ranks). So, as for a parameter,
// the copy that counts is index 0 of each replicate dim and the first member
// of a pipeline dim: the one a checkpoint saves.
void place_buffers(models::Model& model, DeviceMesh& mesh, Placements& placements) {
  for (const auto& b : model.named_buffers(/*recurse=*/true)) {
    ShardSpec& spec = placements.of(b.value());
    for (const auto& name : mesh.names()) {
      if (spec.find(name)) continue;
      Group& g = mesh.group(name);
      spec.dims.push_back({name, &g, g.size, g.rank, Placement::replicate(), Placement::replicate()});
    }
  }
}

}  // namespace

Parallel parallelize(models::Model& model, const std::vector<Transform>& transforms, const ParallelizeOptions& o) {
  Parallel par;
  par.roots = {models::whole(model)};
  par.world = o.world;
  par.dp = o.data_parallel;
  for (size_t i = 0; i < transforms.size(); ++i) {
    auto trace_later = [&transforms, i](Tracing& t) {
      for (size_t j = i + 1; j < transforms.size(); ++j)
        std::visit([&t](const auto& c) { trace(t, c); }, transforms[j]);
    };
    Applying a{model, par, o, trace_later};
    const bool spreads = std::visit([&a](const auto& c) { return apply(a, c); }, transforms[i]);
    par.any = par.any || spreads;
  }
  // Activation checkpointing alone changes how a unit computes, not where:
  // nothing is spread over ranks and nothing needs synchronising.
  if (!par.any) par.world = par.dp = nullptr;
  if (par.any && o.mesh) place_buffers(model, *o.mesh, *par.placements);
  return par;
}

}  // namespace composer::parallel

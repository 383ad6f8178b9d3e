#include "parallelisms/replicate.h"

#include <sstream>

#include "parallelisms/parallel.h"
#include "parallelisms/per_rank.h"

namespace composer::parallel {

void apply_replicate(const std::vector<models::Root>& roots, Group& group, const ReplicateConfig& options,
                     Placements& placements) {
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : models::root_parameters(roots)) {
    if (per_rank_selects(options.per_rank, name)) continue;  // each rank's own: neither broadcast nor reduced
    // A planning mesh has no process groups; a model built on meta (its
    // values drawn later, the same on every rank) has nothing to send yet.
    if (group.pg && !p.is_meta()) broadcast(group, p, 0);
    placements.add(p, {group.name, &group, group.size, group.rank, Placement::replicate(),
                       Placement::partial(Reduce::kAvg)});
  }
}

void apply_replicate(models::Model& model, Group& group, const ReplicateConfig& options, Placements& placements) {
  apply_replicate({models::whole(model)}, group, options, placements);
}

bool apply(Applying& a, const ReplicateConfig& config) {
  Parallel& par = a.par;
  Group& group = a.group(config.mesh_dim);
  if (!config.per_rank.empty()) par.per_rank = apply_per_rank(par.roots, group, config.per_rank, *par.placements);
  par.take_over_cp(group);
  apply_replicate(par.roots, group, config, *par.placements);
  par.bucket_mb = config.bucket_mb;
  std::ostringstream mb;
  mb << par.bucket_mb;
  a.log("applied replicate " + over(&group) + ": gradients all-reduced in buckets of " + mb.str() + " MB");
  return true;
}

void trace(Tracing&, const ReplicateConfig&) {}

}  // namespace composer::parallel

#include "parallelisms/replicate.h"

#include "parallelisms/per_rank.h"

namespace composer::parallel {

void apply_replicate(const std::vector<models::Root>& roots, Group& group, const ReplicateOptions& options,
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

void apply_replicate(models::Model& model, Group& group, const ReplicateOptions& options, Placements& placements) {
  apply_replicate({models::whole(model)}, group, options, placements);
}

}  // namespace composer::parallel

#include "parallelisms/replicate.h"

namespace composer::parallel {

void apply_replicate(models::Model& model, Group& group, const ReplicateOptions& options, Placements& placements) {
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    if (options.param_filter && !options.param_filter(p)) continue;
    // A planning mesh has no process groups; a model built on meta (its
    // values drawn later, the same on every rank) has nothing to send yet.
    if (group.pg && !p.is_meta()) broadcast(group, p, 0);
    placements.add(p, {group.name, &group, group.size, group.rank, Placement::replicate(),
                       Placement::partial(Reduce::kAvg)});
  }
}

}  // namespace composer::parallel

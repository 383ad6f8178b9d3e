#include "parallelisms/per_rank.h"

#include "models/select.h"

namespace composer::parallel {

bool per_rank_selects(const std::vector<std::string>& patterns, const std::string& fqn) {
  for (size_t end = fqn.find('.'); ; end = fqn.find('.', end + 1)) {
    if (models::matches_any(patterns, fqn.substr(0, end))) return true;
    if (end == std::string::npos) return false;
  }
}

std::vector<std::string> per_rank_params(models::Model& model, const std::vector<std::string>& patterns) {
  std::vector<std::string> out;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    if (per_rank_selects(patterns, name)) out.push_back(name);
  }
  return out;
}

ParamSet apply_per_rank(const std::vector<models::Root>& roots, Group& group, const std::vector<std::string>& patterns,
                        Placements& placements) {
  ParamSet out;
  for (auto& [name, p] : models::root_parameters(roots)) {
    if (!per_rank_selects(patterns, name)) continue;
    ShardSpec& spec = placements.of(p);
    TORCH_INTERNAL_ASSERT(spec.dims.empty(), name, " is per-rank and already placed: ", spec.str());
    spec.global_shape.insert(spec.global_shape.begin(), group.size);
    spec.dims.push_back({group.name, &group, group.size, group.rank, Placement::shard(0), Placement::shard(0)});
    out.insert(p.unsafeGetTensorImpl());
  }
  return out;
}

void copy_per_rank(models::Model& model, models::Model& source, const std::vector<std::string>& patterns) {
  torch::NoGradGuard no_grad;
  auto from = nn::unique_named_parameters(source);
  auto to = nn::unique_named_parameters(model);
  TORCH_INTERNAL_ASSERT(from.size() == to.size(), "the per-rank source model has other parameters");
  for (size_t i = 0; i < to.size(); ++i) {
    TORCH_INTERNAL_ASSERT(from[i].first == to[i].first, "per-rank source parameter ", from[i].first, " vs ",
                          to[i].first);
    if (per_rank_selects(patterns, to[i].first)) to[i].second.copy_(from[i].second);
  }
}

}  // namespace composer::parallel

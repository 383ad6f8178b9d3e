// Per-rank parameters: each data-parallel rank keeps its own values (the
// experts of a mixture of experts), neither sharded nor reduced. In the
// placement model such a tensor is the stack of every rank's copy: its global
// shape gets a leading dim of the group's size, and it is Shard(0) over the
// group, parameter and gradient alike. So the gradient synchronisation reduces
// nothing, every rank's copy counts in the gradient norm, and gathering,
// exporting or checkpointing it yields every rank's values, [ranks, ...].
// fully_shard and replicate leave such parameters alone.
#pragma once
#include <torch/torch.h>

#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/config_fields.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

// Whether a pattern selects the parameter `fqn`: it matches the parameter's
// FQN or the FQN of a module holding it ("module.2" and "module.2.*" both
// select module.2.weight).
bool per_rank_selects(const std::vector<std::string>& patterns, const std::string& fqn);

// The FQNs of the parameters `patterns` select, in registration order.
std::vector<std::string> per_rank_params(models::Model& model, const std::vector<std::string>& patterns);

// The per_rank options fully_shard's and replicate's Configs share (config_fields.h).
struct PerRankFields {
  std::vector<std::string> per_rank;
  int64_t per_rank_seed = -1;

  template <class V>
  void fields(V& v) {
    v("per_rank", per_rank);            // parameters (FQN patterns) each rank keeps its own
    v("per_rank_seed", per_rank_seed);  // rank i draws them with the model's init under seed + i (-1: keep)
  }
  // A seed below -1, or a seed without patterns.
  std::optional<FieldError> check_per_rank() const {
    if (per_rank_seed < -1) {
      return FieldError{"per_rank_seed", "per_rank_seed must be >= 0 (rank i draws with seed + i), or -1 to keep "
                                         "the model's init"};
    }
    if (per_rank_seed >= 0 && per_rank.empty()) {
      return FieldError{"per_rank_seed", "per_rank_seed needs per_rank: the parameters drawn per rank (e.g. "
                                         "per_rank: [experts.*])"};
    }
    return std::nullopt;
  }
};

// The set of per-rank parameters (by TensorImpl) that apply_per_rank returns.
using ParamSet = std::unordered_set<const c10::TensorImpl*>;

// Records the selected parameters as per-rank over `group` (stacked, Shard(0)).
ParamSet apply_per_rank(const std::vector<models::Root>& roots, Group& group, const std::vector<std::string>& patterns,
                        Placements& placements);

// Copies the selected parameters of `source` (the same model built under this
// rank's seed) into `model`: each rank's own initial values.
void copy_per_rank(models::Model& model, models::Model& source, const std::vector<std::string>& patterns);

}  // namespace composer::parallel

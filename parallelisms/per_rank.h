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

// fully_shard's and replicate's per_rank options: the patterns and the seed
// rank i draws its values with (seed + i; -1 keeps the model's init). Their
// check refuses a seed below -1 or a seed without patterns.
std::optional<FieldError> check_per_rank(const std::vector<std::string>& patterns, int64_t seed);

// The set of per-rank parameters (by TensorImpl) that apply_per_rank returns.
using ParamSet = std::unordered_set<const c10::TensorImpl*>;

// Records the selected parameters as per-rank over `group` (stacked, Shard(0)).
ParamSet apply_per_rank(const std::vector<models::Root>& roots, Group& group, const std::vector<std::string>& patterns,
                        Placements& placements);

// Copies the selected parameters of `source` (the same model built under this
// rank's seed) into `model`: each rank's own initial values.
void copy_per_rank(models::Model& model, models::Model& source, const std::vector<std::string>& patterns);

}  // namespace composer::parallel

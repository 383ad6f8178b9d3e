// The planner: a pure function from a config and a world size to a Plan.
// It creates no process group, so every rule is unit-testable, and every
// error names the numbers, where they came from and the fix.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "runner/config/config.h"

namespace composer {

struct Plan {
  int64_t world_size = 1;                 // ranks in the job (the mesh's product)
  std::vector<std::string> dp_dims;       // mesh dims that data parallelism spans
  // The batch geometry, computed here once: the ranks that split the global
  // batch, each one's samples per step, the step's microbatches (the
  // pipeline's when there is one) and the samples in each.
  int64_t dp_size = 1;
  int64_t local_batch = 0;
  int64_t microbatches = 1;
  int64_t local_microbatch = 0;
  // Eval's batch geometry (eval.global_batch, eval.seq_len; training's without them).
  int64_t eval_local_batch = 0;
  int64_t eval_local_microbatch = 0;
  // Validated, in application order, each with what the planner resolved (a
  // tensor-parallel plan's rules, a pipeline's microbatches).
  std::vector<TransformConfig> transforms;
  std::vector<std::vector<std::string>> flat_groups; // multi-dim process groups to create
  // Parameters each data-parallel rank keeps its own (fully_shard's or
  // replicate's per_rank), the seed they are drawn with and the dims they differ over.
  struct PerRank {
    std::vector<std::string> patterns;
    int64_t seed = -1;
    std::vector<std::string> mesh_dim;
  };
  std::optional<PerRank> per_rank;
  bool splits_model = false;              // tensor_parallel, fully_shard or a pipeline: ranks hold parts
  std::vector<std::string> summary;       // what will run, one line each
  // Accepted plans that train differently from one device in a way the user
  // likely did not mean: "file:line: key: what happens; the fix".
  std::vector<std::string> warnings;

  // The transform of type T (its resolved options), or nullptr.
  template <class T>
  const T* find() const {
    for (const auto& t : transforms) {
      if (const T* o = t.get<T>()) return o;
    }
    return nullptr;
  }
  // The transforms as parallelize takes them.
  std::vector<parallel::Transform> steps() const;
};

// Validates `c` for `world_size` ranks; throws PlanError.
Plan make_plan(const ExperimentConfig& c, int64_t world_size);

// Rank 0 and the first rank of every other pipeline stage: together they hold
// every parameter ({0} without a pipeline).
std::vector<int> stage_first_ranks(const ExperimentConfig& c, const Plan& plan);

// Checks that this machine has what mesh.device asks for, `local_ranks` of the
// job's ranks running here: for cuda, composer's CUDA library, a visible GPU
// and one GPU per local rank. Unlike make_plan it looks at the machine (and
// loads the CUDA library, before anything else asks LibTorch about CUDA).
void check_devices(const ExperimentConfig& c, int64_t local_ranks);

}  // namespace composer

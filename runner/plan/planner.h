// The planner: a pure function from a config and a world size to a Plan.
// It creates no process group, so every rule is unit-testable, and every
// error names the numbers, where they came from and the fix.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "models/tp_plan.h"
#include "runner/config/config.h"

namespace composer {

struct Plan {
  int64_t world_size = 1;                 // ranks in the job (the mesh's product)
  std::vector<std::string> dp_dims;       // mesh dims that data parallelism spans
  int64_t dp_size = 1;                    // ranks that split the global batch
  int64_t local_batch = 0;                // samples per data-parallel rank per step
  int64_t local_microbatch = 0;           // samples per microbatch on a rank
  int64_t tp_size = 1;                    // tensor-parallel degree (1 = none)
  models::TpPlan tp_plan;                 // the model's plan, when tensor_parallel is used
  std::string loss_parallel;              // loss parallel: the module whose logits stay vocab-sharded
  std::vector<TransformConfig> transforms;           // validated, in application order
  std::vector<std::vector<std::string>> flat_groups; // multi-dim process groups to create
  int64_t cp_size = 1;                    // context-parallel degree (1 = none)
  std::string cp_dim;                     // its mesh dim
  std::optional<ContextParallelConfig> context_parallel;  // its options, when the plan has it
  int64_t pp_size = 1;                    // pipeline ranks (1 = no pipeline)
  int64_t pp_microbatches = 0;            // pipeline microbatches per step
  std::optional<PipelineConfig> pipeline; // the pipeline's options, when the plan has one
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

// The planner: a pure function from a config and a world size to a Plan.
// It creates no process group, so every rule is unit-testable, and every
// error names the numbers, where they came from and the fix.
#pragma once
#include <string>
#include <vector>

#include "runner/config.h"

namespace composer {

struct Plan {
  int64_t world_size = 1;    // ranks in the job (the mesh's product)
  int64_t local_ranks = 1;   // ranks on this machine (threads are split among them)
  std::string log_prefix;    // "[rank r/N] "
  std::vector<std::string> summary;  // what will run, one line each
};

// Validates `c` for `world_size` ranks; throws PlanError.
Plan make_plan(const ExperimentConfig& c, int64_t world_size);

}  // namespace composer

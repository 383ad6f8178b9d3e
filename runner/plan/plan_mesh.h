// The planner's first checks (plan_mesh.cpp): the mesh, which transform
// serves which dim in what order.
#pragma once
#include <string>
#include <vector>

#include "runner/config/config.h"

namespace composer {

std::string join(const std::vector<std::string>& v);  // "a, b, c"
int64_t dim_size(const MeshConfig& m, const std::string& name);  // 0 for a dim the mesh lacks
// The mesh's product is the job's rank count; nccl needs cuda.
void check_mesh(const ExperimentConfig& c, int64_t world_size);
// Whether the transform's dims split the batch (its Config's kSplits: today
// fully_shard, replicate and expert_parallel, whose ranks route their own tokens).
bool data_parallel(const TransformConfig& t);
// The mesh dim the sequence-splitting transform (kSplits kSequence:
// context_parallel) splits sequences over ("" without one).
std::string context_parallel_dim(const ExperimentConfig& c);
// Each transform names mesh dims that exist, each dim serves one transform
// (with the shares composition allows), the order rule holds, and every dim
// of more than one rank is used.
void check_order_and_dims(const ExperimentConfig& c);

}  // namespace composer

// Each rank's memory, predicted from shapes before anything runs: the model is
// built on the meta device (shapes, no storage), the plan's transforms are
// applied to it for every rank on a mesh without process groups, and one
// microbatch's forward and backward runs on meta tensors while their bytes
// are counted (memory.h). `composer plan` prints it; the planner refuses a
// plan whose peak exceeds what a rank may use. The counting CPU allocator
// measures the same terms in a real run (memory.rank<r>.json).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runner/config.h"
#include "runner/planner.h"

namespace composer {

struct MemoryEstimate {
  int rank = 0;
  int64_t params = 0;       // the parameter pieces this rank holds
  int64_t grads = 0;        // their gradients
  int64_t optimizer = 0;    // optimizer state (Adam: 2 per parameter; SGD with momentum: 1)
  int64_t buffers = 0;      // fully_shard's unsharded parameters while gathered
  int64_t activations = 0;  // forward and backward of one microbatch over the parameters
                            // (gradients as they form included), times the microbatches in flight
  int64_t data = 0;         // dataset tensors held in memory
  // The most alive at once: the step's forward and backward, or after it the
  // gradients, whichever is larger, over what always lives.
  int64_t peak() const;
  std::string str() const;  // "params 1.2 MiB, grads ..., peak ..."
};

// One estimate per rank (ranks with the same shapes are estimated once and
// copied). Throws what building the model or applying the plan throws.
std::vector<MemoryEstimate> estimate_memory(const ExperimentConfig& c, const Plan& plan);

// The bytes a rank may use: mesh.memory_per_rank_mb when set, else the host's
// physical memory divided by the local ranks.
int64_t memory_per_rank(const ExperimentConfig& c, int64_t local_ranks);

// Throws PlanError at the mesh section when a rank's estimated peak exceeds
// memory_per_rank, with every term and the transform that would shrink the
// largest one.
void check_fit(const ExperimentConfig& c, const std::vector<MemoryEstimate>& estimates, int64_t local_ranks);

std::string format_bytes(int64_t bytes);

}  // namespace composer

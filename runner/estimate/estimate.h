// Each rank's memory and communication, predicted from shapes before
// anything runs: every rank's first two training steps run dry (dry_run.h: the model on the meta device, the plan applied on a mesh without
// process groups, the same step code as a real run) while the bytes of every
// meta tensor and every collective are counted. `composer plan` prints it;
// the planner refuses a plan whose peak exceeds what a rank may use. The
// counting CPU allocator and the collective counters measure the same terms
// in a real run (memory.rank<r>.json, comm.rank<r>.json).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/plan/planner.h"
#include "parallelisms/comm/p2p.h"
#include "runner/estimate/dry_run.h"

namespace composer {

struct MemoryEstimate {
  int rank = 0;
  int64_t params = 0;       // the parameter pieces this rank holds
  int64_t grads = 0;        // their gradients
  int64_t optimizer = 0;    // optimizer state (Adam: 2 per parameter; SGD with momentum: 1)
  int64_t buffers = 0;      // communication buffers the transforms keep: fully_shard's pools
                            // (send, receive, unsharded, gradient), gradient buckets
  int64_t activations = 0;  // the rest of the step's peak: activations of the microbatches in
                            // flight, gradients as they form, collective staging, temporaries
  int64_t data = 0;         // dataset tensors held in memory, and the next step's batch read ahead
  int64_t step_peak = 0;    // the most tensor bytes alive at once in a step (data aside)
  int64_t checkpoint_copy = 0;  // checkpoint.async: the host copy a save keeps while it writes (at most)
  CommBytes comm;           // the bytes one step's collectives move, per group and kind
  int64_t peak() const;     // step_peak + data + checkpoint_copy
  std::string str() const;  // "params 1.2 MiB, grads ..., peak 5.1 MiB (5347737 B)"
  std::string comm_str() const;  // "dp all_gather 1234 B, dp reduce_scatter ..." (exact bytes)
};

// One estimate per rank (ranks with the same shapes are estimated once and
// copied). Throws what building the model or applying the plan throws.
// Keeps composer's meta kernels (meta_kernels.cpp) in a program's link: call it
// before running operators on meta tensors whose counts must be a CPU run's.
void ensure_meta_kernels();

// `local_ranks`: the ranks on each machine, which share its cores (0: every rank).
std::vector<MemoryEstimate> estimate_memory(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks = 0);

// The largest of estimate_memory's per-rank peaks, from fewer dry runs where a pipeline allows: under
// 1F1B and interleaved 1F1B no dry run of a rank that the rank before it provably peaks above (composer
// suggest). `stop_above` > 0: a dry run whose step passes that many bytes stops there, and the result is
// stop_above + 1, over by an amount not measured.
int64_t estimate_peak(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks = 0, int64_t stop_above = 0);

// The bytes a rank may use: mesh.memory_per_rank_mb when set, else the host's
// physical memory divided by the local ranks.
int64_t memory_per_rank(const ExperimentConfig& c, int64_t local_ranks);

// Throws PlanError at the mesh section when a rank's estimated peak exceeds
// memory_per_rank, with every term and the transform that would shrink the
// largest one.
void check_fit(const ExperimentConfig& c, const std::vector<MemoryEstimate>& estimates, int64_t local_ranks);

std::string format_bytes(int64_t bytes);

// A batch of `n` samples as the dataset makes them, on the meta device.
Batch meta_batch(const DataPlan& p, int64_t n);

// The sends and receives each of `ranks` issues in one training step,
// recorded from a dry run of that rank: the sequences the checker of NCCL's rules reads (parallelisms/comm/p2p_check.h).
std::map<int, parallel::P2PLog> p2p_logs(const ExperimentConfig& c, const Plan& plan, const std::vector<int>& ranks);

}  // namespace composer

// `composer suggest`: the plans of a model for a world of ranks, searched,
// checked and ranked. Every candidate (tp, cp, pp with its schedule and
// microbatches, dp as replicate, fully_shard or HSDP, activation checkpointing
// none, op or full, gradient accumulation) is written as the mesh and
// parallelize sections of the user's config and goes through the planner;
// the accepted ones are ranked by a cost model, and in that order each is run
// dry (the per-rank memory estimate, exact to the byte) until `top` of them
// fit the device memory with the margin. The best is written as a config.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/plan/planner.h"

namespace composer {

// The machines a plan is sought for, and the rates the cost model prices work at.
struct World {
  int64_t ranks_per_node = 1;
  int64_t nodes = 1;
  int64_t memory_per_rank = 0;  // bytes a rank may use
  double margin = 0.1;          // the fraction of memory_per_rank a plan must leave free
  double matmul_flops = 0;      // per rank, FLOP/s
  // When set, a rank's rate for a plan's own matmul shape (rows: the tokens of
  // one microbatch on a rank; the model's dim; dim / tp), in place of matmul_flops.
  std::function<double(int64_t rows, int64_t k, int64_t n)> matmul_rate;
  double intra_bytes_per_s = 0;  // a rank's bandwidth to ranks of its node
  double inter_bytes_per_s = 0;  // to ranks of other nodes
  int64_t size() const { return ranks_per_node * nodes; }
};

struct Candidate {
  std::string name;   // "tp2.cp1.pp2_1f1b_m4.fsdp.ac_op.mb1"
  std::string yaml;    // the whole config: the user's sections (accumulation searched in) and its mesh and parallelize
  std::string family;              // the name less activation checkpointing (and accumulation without a pipeline)
  // The cost model's step: compute (model FLOPs, recompute included, over
  // the matmul rate, stretched by the pipeline's bubble) plus every
  // collective's bytes over its level's bandwidth, nothing overlapped.
  double compute_s = 0, comm_s = 0, bubble = 0;
  double rate = 0;  // the matmul rate compute_s assumes, FLOP/s per rank
  double step_s() const { return compute_s + comm_s; }
  int64_t peak = -1;    // the dry run's largest per-rank peak; -1: not run dry
  bool fits = false;
};

struct Suggestion {
  std::vector<Candidate> fitting;   // best first
  std::vector<Candidate> unfit;     // run dry, over the memory, in cost order
  int64_t candidates = 0, refused = 0, estimated = 0;
  std::string first_refusal;        // an example of the planner's reasons
  double flops_per_step = 0;        // the model's, one step of the global batch: 6 x matrix parameters per
                                    // token (embedding tables left out) + attention's 12 x layers x dim x seq
};

// Throws UserError for an override of the mesh or parallelize, which suggest chooses.
void check_suggest_overrides(const std::vector<std::string>& overrides);

// Searches the plans of the config at `path` (with `overrides`; its own mesh
// and parallelize are ignored) for `world`; `max_estimates` caps the dry runs.
Suggestion suggest(const std::string& path, const std::vector<std::string>& overrides, const World& world, int top,
                   int max_estimates);

// The config of the plan fitting[pick] (0: the best), headed by a comment on
// the choice, the runners-up and the rates assumed.
std::string suggested_yaml(const Suggestion& s, const World& world, size_t pick = 0);

// One float32 matmul's rate on this machine's cores, FLOP/s: (rows x k) by
// (k x n), repeated for about `seconds`.
double measure_matmul_flops(int64_t rows = 1024, int64_t k = 1024, int64_t n = 1024, double seconds = 0.5);

}  // namespace composer

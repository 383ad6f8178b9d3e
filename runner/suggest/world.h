// What `composer suggest` prices plans for (the world of ranks and the rates
// measured for it) and what a price is made of (one rank's step, term by term).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "runner/suggest/probe.h"

namespace composer {

// The machines a plan is sought for, and the rates the cost model prices work at.
struct World {
  int64_t ranks_per_node = 1;
  int64_t nodes = 1;
  int64_t memory_per_rank = 0;  // bytes a rank may use
  double margin = 0.1;          // the fraction of memory_per_rank a plan must leave free
  // The bytes a plan may use: memory_per_rank less the margin.
  double usable() const { return (1.0 - margin) * static_cast<double>(memory_per_rank); }
  bool cuda = false;            // the device has bfloat16 and float8 matmuls worth searching
  double overlap = 0;           // the fraction of fully_shard's gathers hidden behind compute (prefetch)
  MachineRates rates;           // measured here, cached, given (--rates) or a device's defaults
  int64_t size() const { return ranks_per_node * nodes; }
};

// A plan's step on one rank, term by term (seconds): what the cost model adds up.
struct StepTerms {
  double matmul_s = 0;       // the model's matmuls (attention's included) at the rate of the plan's shapes
  double elementwise_s = 0;  // norms, rotary, activations, residuals, the loss: bytes over the elementwise rate
  double kernels_s = 0;      // each op's fixed cost, per microbatch and layer
  double optimizer_s = 0;    // the optimizer's pass over the rank's parameters
  double recompute_s = 0;    // activation checkpointing's repeated forward (in the terms above too: its share)
  double bubble = 0;         // the schedule's idle fraction
  double bubble_s = 0;       // the time it adds to the compute
  // Communication a step waits for, by what moves it: tp, cp, dp (replicate, fully_shard, HSDP), pp, ep.
  double tp_s = 0, cp_s = 0, dp_s = 0, pp_s = 0, ep_s = 0;
  double stats_s = 0;        // the step's small collectives: the gradient norm, the loss, the metrics
  double hidden_s = 0;       // of dp_s, hidden behind compute
  // The core time data parallelism's collectives take from the compute where ranks share a CPU's cores (its
  // buckets and prefetched gathers run beside the backward and forward): the bytes sent, dp_bytes, at the
  // probe's core time per byte. 0 on a GPU.
  double dp_bytes = 0, comm_core_s = 0;
  double comm_latency_s = 0; // of the six, the collectives' latency (the rest is their bytes)
  // The collectives and sends the six count a step and the bytes a rank sends in them under the ring
  // algorithms (a run's comm_calls and comm_ring_bytes in metrics.jsonl count the same).
  double calls = 0, sent_bytes = 0;
  double rate = 0;           // the matmul rate assumed at the plan's main shape, FLOP/s per rank
  // The machine's refit factors (composer suggest --from-run): compute, communication's latency and its bytes.
  double compute_fit = 1, latency_fit = 1, bandwidth_fit = 1;
  double compute_s() const {
    return (matmul_s + elementwise_s + kernels_s + optimizer_s + comm_core_s) * compute_fit + bubble_s;
  }
  double raw_comm_s() const { return tp_s + cp_s + dp_s + pp_s + ep_s + stats_s - hidden_s; }
  double comm_s() const { return comm_latency_s * latency_fit + (raw_comm_s() - comm_latency_s) * bandwidth_fit; }
  double step_s() const { return compute_s() + comm_s(); }
  // Every term by name, in ms, for --json and the explanation.
  std::vector<std::pair<std::string, double>> named_ms() const;
};

}  // namespace composer

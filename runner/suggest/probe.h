// The machine constants `composer suggest` prices plans with, and the probe
// that measures them here: the matmul rate at each plan's own shape, the
// elementwise (memory-bound) rate, the fixed cost of one kernel, and each
// collective's latency and bandwidth per group size. On the CPU every figure is
// taken with the node's ranks running at once (each with the threads a rank
// gets), since they share the cores; the collectives run over real Gloo groups
// between threads while the others compute. The probe's results are cached per
// machine (~/.cache/composer/machine.json, or $COMPOSER_CACHE_DIR) and refit by
// `composer suggest --from-run` from what runs measured.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

namespace composer {

// One collective's cost on a group: latency + bytes a rank sends / bandwidth.
struct LinkCost {
  double latency_s = 0;
  double bytes_per_s = 0;
  double seconds(double calls, double bytes) const {
    return calls * latency_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 0.0);
  }
};

struct MachineRates {
  std::string key;             // "cpu ranks4 threads1 cores2", the cache entry
  std::string source;          // how the figures were obtained, for the output
  std::string origin;          // how they were first obtained ("probed here in 6 s"), as the cache keeps it
  double matmul_flops = 0;     // per rank, FLOP/s, where no shape was measured
  double elementwise_bytes_per_s = 0;  // per rank, bytes read and written by memory-bound ops
  double kernel_s = 0;         // per op a step runs (its dispatch and autograd bookkeeping)
  LinkCost intra, inter;       // within a node (the largest group measured) and across
  std::map<int64_t, LinkCost> intra_by_size;  // measured: a group of that many ranks within a node
  std::map<int64_t, LinkCost> exchange_by_size;  // measured: an all-to-all of that many ranks within a node
  std::map<int64_t, LinkCost> reduce_by_size;    // measured: an all-reduce of that many ranks within a node
  bool concurrent = true;      // figures taken with the node's ranks at once on shared cores
  int64_t cores = 0;           // the cores the node's ranks share (0: not known, or not shared)
  // The share of a core a rank's thread gets while every rank computes: cores over the node's threads,
  // 1 where they do not outnumber the cores (or the cores are not known). A rank that waits while the
  // others compute leaves them its share.
  double core_share() const;
  // Refit from runs (composer suggest --from-run): each run's unfitted prediction (compute, and
  // communication's latency and bytes parts) and its measurement; the factors fitted to them all.
  struct FittedRun {
    std::string plan;
    double compute = 0, latency = 0, bytes = 0, measured_compute = 0, measured_comm = 0;
  };
  std::vector<FittedRun> runs;
  double compute_fit = 1, latency_fit = 1, bandwidth_fit = 1;
  int64_t runs_fitted = 0;
  // Sets the factors from `runs`: each run's measured step against compute_fit x its predicted compute +
  // a communication factor (latency's and bytes' alike) x its predicted communication, by least squares on
  // the relative error; one factor for both from one run, or where the two would not both be above 0.
  void refit();
  // The matmul rate at (rows, k, n), measured on first use where `measure` is set (and cached).
  double matmul_rate(int64_t rows, int64_t k, int64_t n);
  // Seconds per element of the work `what` names (a key of the cache), where `make(elements)` readies one
  // rank's work over that many parameter elements and returns one pass of it: measured with the node's
  // ranks at once on first use where `measure` is set (and cached); 0 where neither measured nor measurable.
  double per_element_s(const std::string& what, const std::function<std::function<void()>(int64_t)>& make);
  LinkCost link(int64_t group_size, bool within_node) const;
  // The collectives composer runs natively over Gloo, where link's are its rings of g - 1 hops (fully_shard's
  // gathers, sequence parallelism, context parallelism's ring and allgather): an all-to-all (every pair at
  // once: expert_parallel's dispatch, the alltoall context parallelism) and an all-reduce (replicate's
  // buckets, tensor parallelism without sequence parallelism, the step's statistics). Measured on first use
  // within a node where `measure` is set and the group divides the node's ranks (and cached); else link's.
  enum class Collective { kAllToAll, kAllReduce };
  LinkCost native(Collective kind, int64_t group_size, bool within_node);
  // One line: "rates (SOURCE): matmul ..., collectives ..., refit ...", for the output and the suggested file.
  std::string describe() const;
  std::map<std::tuple<int64_t, int64_t, int64_t>, double> shapes;  // measured matmul rates
  std::map<std::string, double> per_element;  // measured per_element_s, by what
  // The core time a collective's bytes take from the ranks computing beside it on shared cores (Gloo's copies
  // through the sockets and its reductions run on the node's cores), per byte sent; -1 until measured, 0 where
  // the cores are not shared. Measured on first use where `measure` is set (comm_core_s).
  double comm_core_s_per_byte = -1;
  double comm_core_s();
  bool measure = false;
  int threads = 1;             // a rank's threads
  int64_t ranks = 1;           // the node's ranks that run at once
  bool dirty = false;          // shapes measured since loading: save again
};

nlohmann::json to_json(const MachineRates& r);
MachineRates rates_from_json(const nlohmann::json& j, const std::string& where);

// The cache file, and the entry for this machine with `ranks` ranks of `threads` threads.
std::string machine_cache_path();
std::string machine_key(int64_t ranks, int threads);

// This machine's rates for `ranks` concurrent ranks of `threads` threads: from the cache, else
// probed (a few seconds) and cached; `again` probes even when cached.
MachineRates probe_machine(int64_t ranks, int threads, bool again);

// Saves `r` into the cache under its key (the other entries kept).
void save_rates(const MachineRates& r);

// Rates for a GPU of the H100 class where none were measured or given: bfloat16 matmuls, HBM,
// NVLink within a node and InfiniBand across.
MachineRates gpu_default_rates();

// Rates from a JSON file the user gives (--rates): the cache's format, one entry; or the
// summary.json tools/gpu-bench writes (`cuda` set), whose composer step gives the matmul rate
// (the model's FLOPs per step over its median step time) and the GPU defaults the rest.
MachineRates rates_from_file(const std::string& path, bool cuda);

}  // namespace composer

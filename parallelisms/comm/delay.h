// Injected delays at named points of a step (debug.delay), for exposing races:
// a rank that sleeps before a collective, before freeing unsharded storage or
// before the optimizer step must still compute exactly what it computes
// without the sleep, because every consumer waits for what it reads. The
// collectives sleep at their own points (the delays travel with each Group),
// the transforms and the trainer at theirs.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace composer::parallel {

enum class DelayPoint {
  kAfterLoss,            // the loss is computed; backward and the optimizer step follow
  kBeforeOptimizerStep,  // gradients are reduced; the optimizer step follows
  kBeforeAllGather,      // before an all-gather's ring starts (on its helper thread when async)
  kBeforeAllGatherWait,  // fully_shard: before waiting for a unit's all-gather
  kBeforeReduceScatter,  // before every reduce-scatter
  kBeforeAllReduce,      // before every all-reduce (replicate buckets, HSDP, tp sums)
  kBeforeFree,           // fully_shard: before freeing a unit's unsharded storage
  kBeforeSend,           // pipeline: before every point-to-point send
  kBeforeRecv,           // pipeline: before every point-to-point receive
  kBeforeAllToAll,       // expert_parallel: before every all-to-all (counts, tokens, outputs)
};

// The name table: {kBeforeReduceScatter, "before_reduce_scatter"}, ...
struct DelayPointName {
  DelayPoint point;
  const char* name;
};
const std::vector<DelayPointName>& delay_point_names();
const char* name_of(DelayPoint p);

// One entry: sleep `ms` milliseconds at `point` on `ranks` (global ranks; empty = every rank).
struct Delay {
  DelayPoint point = DelayPoint::kAfterLoss;
  int64_t ms = 0;
  std::vector<int64_t> ranks;
};

// The delays of one rank.
class Delays {
 public:
  Delays(const std::vector<Delay>& delays, int rank);
  // Sleeps for every entry at `p` on this rank (their sum); thread-safe.
  void at(DelayPoint p) const;
  bool empty() const { return ms_.empty(); }
  // How many sleeps this rank took, and their milliseconds in all: proof
  // that the points were reached.
  int64_t slept() const { return slept_; }
  int64_t slept_ms() const { return slept_ms_; }

 private:
  std::vector<std::pair<DelayPoint, int64_t>> ms_;
  mutable std::atomic<int64_t> slept_{0}, slept_ms_{0};
};

// `delays` may be null (no delays).
inline void delay_at(const std::shared_ptr<const Delays>& delays, DelayPoint p) {
  if (delays) delays->at(p);
}

}  // namespace composer::parallel

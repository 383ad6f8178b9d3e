#include "parallelisms/comm/delay.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace composer::parallel {

const std::vector<DelayPointName>& delay_point_names() {
  static const std::vector<DelayPointName> names = {
      {DelayPoint::kAfterLoss, "after_loss"},
      {DelayPoint::kBeforeOptimizerStep, "before_optimizer_step"},
      {DelayPoint::kBeforeAllGather, "before_all_gather"},
      {DelayPoint::kBeforeAllGatherWait, "before_all_gather_wait"},
      {DelayPoint::kBeforeReduceScatter, "before_reduce_scatter"},
      {DelayPoint::kBeforeAllReduce, "before_all_reduce"},
      {DelayPoint::kBeforeFree, "before_free"},
      {DelayPoint::kBeforeSend, "before_send"},
      {DelayPoint::kBeforeRecv, "before_recv"},
      {DelayPoint::kBeforeAllToAll, "before_all_to_all"},
  };
  return names;
}

const char* name_of(DelayPoint p) {
  for (const auto& n : delay_point_names()) {
    if (n.point == p) return n.name;
  }
  return "?";
}

Delays::Delays(const std::vector<Delay>& delays, int rank) {
  for (const auto& d : delays) {
    const bool here = d.ranks.empty() || std::find(d.ranks.begin(), d.ranks.end(), rank) != d.ranks.end();
    if (here && d.ms > 0) ms_.emplace_back(d.point, d.ms);
  }
}

void Delays::at(DelayPoint p) const {
  for (const auto& [point, ms] : ms_) {
    if (point != p) continue;
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    ++slept_;
    slept_ms_ += ms;
  }
}

}  // namespace composer::parallel

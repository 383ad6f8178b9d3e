// The simulator of schedule.h: every rank's action list run with costed
// compute, instant sends, and receives that wait for their send.
#include "parallelisms/pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace composer::parallel {

double Simulation::bubble() const {
  if (makespan == 0 || start.empty()) return 0;
  return 1.0 - static_cast<double>(compute_slots) / (static_cast<double>(start.size()) * makespan);
}

namespace {

bool is_compute(Op op) {
  return op == Op::kForward || op == Op::kBackward || op == Op::kBackwardInput || op == Op::kBackwardWeight;
}

// The state of a simulation: which compute actions ended at which slot, which
// sends were made and received, and each rank's next action and clock.
class Simulator {
 public:
  Simulator(const std::vector<RankActions>& lists, const PipelineShape& s, const ActionCosts& costs)
      : lists_(lists), s_(s), costs_(costs), R_(static_cast<int>(lists.size())), pc_(R_, 0), clock_(R_, 0) {}

  Simulation run() {
    if ((sim_.error = misplaced()).empty()) {
      sim_.start.assign(R_, {});
      for (int r = 0; r < R_; ++r) sim_.start[r].assign(lists_[r].size(), -1);
      for (bool progress = true; progress && sim_.error.empty();) {
        progress = false;
        for (int r = 0; r < R_ && sim_.error.empty(); ++r) {
          while (pc_[r] < lists_[r].size() && advance(r)) progress = true;
        }
      }
      if (sim_.error.empty()) sim_.error = incomplete();
    }
    if (!sim_.error.empty()) return sim_;
    for (int r = 0; r < R_; ++r) sim_.makespan = std::max(sim_.makespan, clock_[r]);
    sim_.ok = true;
    return sim_;
  }

 private:
  using Key = std::tuple<int, int, int>;  // (op, stage, microbatch)
  static Key key(Op op, int st, int mb) { return std::make_tuple(static_cast<int>(op), st, mb); }
  int64_t end_of(Op op, int st, int mb) const {  // the slot a compute action ended, -1: not run
    auto it = done_.find(key(op, st, mb));
    return it == done_.end() ? -1 : it->second;
  }
  int64_t grad_end(int st, int mb) const {  // the input gradient of (st, mb), by B or I
    return std::max(end_of(Op::kBackward, st, mb), end_of(Op::kBackwardInput, st, mb));
  }

  // An action outside the shape or on a rank that does not hold its stage.
  std::string misplaced() const {
    for (int r = 0; r < R_; ++r) {
      for (const Action& a : lists_[r]) {
        if (a.stage < 0 || a.stage >= s_.stages() || a.microbatch < 0 || a.microbatch >= s_.microbatches) {
          return "rank " + std::to_string(r) + ": " + a.str() + " is outside the stages or microbatches";
        }
        if (s_.rank_of(a.stage) != r) return "rank " + std::to_string(r) + " runs " + a.str() + " of a stage it does not hold";
      }
    }
    return "";
  }

  // A receive: false while its send has not been made.
  bool receive(int r, const Action& a, Op send_op, int from_stage) {
    auto it = sent_.find(key(send_op, from_stage, a.microbatch));
    if (it == sent_.end()) return false;
    clock_[r] = std::max(clock_[r], it->second);
    received_.insert(key(a.op, a.stage, a.microbatch));
    return true;
  }

  // What a compute or send action needs that has not happened ("" when
  // nothing), raising `ready` to the slot its local inputs end.
  std::string missing(int r, const Action& a, int64_t& ready) {
    const int S = s_.stages();
    switch (a.op) {
      case Op::kSendActivation:
        if (end_of(Op::kForward, a.stage, a.microbatch) < 0) return "its forward";
        sent_[key(a.op, a.stage, a.microbatch)] = clock_[r];
        return "";
      case Op::kSendGradient:
        if (grad_end(a.stage, a.microbatch) < 0) return "its input gradient";
        sent_[key(a.op, a.stage, a.microbatch)] = clock_[r];
        return "";
      case Op::kForward:
        if (a.stage == 0) return "";
        if (s_.rank_of(a.stage - 1) == r) {
          const int64_t e = end_of(Op::kForward, a.stage - 1, a.microbatch);
          ready = std::max(ready, e);
          return e < 0 ? "F" + std::to_string(a.stage - 1) + " earlier on this rank" : "";
        }
        return received_.count(key(Op::kRecvActivation, a.stage, a.microbatch))
                   ? "" : "a receive of stage " + std::to_string(a.stage - 1) + "'s activation";
      case Op::kBackward:
      case Op::kBackwardInput: {
        std::string why = end_of(Op::kForward, a.stage, a.microbatch) < 0 ? "its forward" : "";
        if (a.stage + 1 >= S) return why;
        if (s_.rank_of(a.stage + 1) == r) {
          const int64_t e = grad_end(a.stage + 1, a.microbatch);
          ready = std::max(ready, e);
          return e < 0 ? "stage " + std::to_string(a.stage + 1) + "'s input gradient earlier on this rank" : why;
        }
        return received_.count(key(Op::kRecvGradient, a.stage, a.microbatch))
                   ? why : "a receive of stage " + std::to_string(a.stage + 1) + "'s gradient";
      }
      case Op::kBackwardWeight:
        return end_of(Op::kBackwardInput, a.stage, a.microbatch) < 0 ? "its input gradient (I)" : "";
      default:
        return "";
    }
  }

  int64_t cost_of(Op op) const {
    switch (op) {
      case Op::kForward: return costs_.forward;
      case Op::kBackward: return costs_.backward;
      case Op::kBackwardInput: return costs_.input;
      default: return costs_.weight;
    }
  }

  // Runs rank r's next action (a forward with the backward overlapped with
  // it: both, as one block); false when it waits for another rank's send or
  // the schedule is invalid (sim_.error).
  bool advance(int r) {
    const Action& a = lists_[r][pc_[r]];
    if (a.op == Op::kRecvActivation) {
      if (!receive(r, a, Op::kSendActivation, a.stage - 1)) return false;
    } else if (a.op == Op::kRecvGradient) {
      if (!receive(r, a, Op::kSendGradient, a.stage + 1)) return false;
    } else {
      const bool pair = pc_[r] + 1 < lists_[r].size() && lists_[r][pc_[r] + 1].overlapped;
      if (a.overlapped || (pair && (a.op != Op::kForward || lists_[r][pc_[r] + 1].op != Op::kBackward))) {
        sim_.error = "rank " + std::to_string(r) + ": " + (a.overlapped ? a : lists_[r][pc_[r] + 1]).str() +
                     " is marked overlapped; only a full backward (B) right after a forward can be";
        return false;
      }
      const size_t n = pair ? 2 : 1;
      int64_t ready = clock_[r];
      for (size_t k = 0; k < n; ++k) {
        const Action& x = lists_[r][pc_[r] + k];
        const std::string why = missing(r, x, ready);
        if (!why.empty()) {
          sim_.error = "rank " + std::to_string(r) + " runs " + x.str() + " before " + why;
          return false;
        }
      }
      if (is_compute(a.op)) {
        const int64_t cost = pair ? costs_.pair() : cost_of(a.op);
        for (size_t k = 0; k < n; ++k) {
          const Action& x = lists_[r][pc_[r] + k];
          if (done_.count(key(x.op, x.stage, x.microbatch))) {
            sim_.error = "rank " + std::to_string(r) + " runs " + x.str() + " twice";
            return false;
          }
          sim_.start[r][pc_[r] + k] = ready;
          done_[key(x.op, x.stage, x.microbatch)] = ready + cost;
        }
        clock_[r] = ready + cost;
        sim_.compute_slots += cost;
        pc_[r] += n - 1;
      }
    }
    ++pc_[r];
    return true;
  }

  // A rank left waiting, a send never received, or a (stage, microbatch) not
  // run both ways.
  std::string incomplete() const {
    for (int r = 0; r < R_; ++r) {
      if (pc_[r] < lists_[r].size()) {
        return "deadlock: rank " + std::to_string(r) + " waits at " + lists_[r][pc_[r]].str() +
               " for a send that never comes";
      }
    }
    for (const auto& [k, slot] : sent_) {
      const auto [op, st, mb] = k;
      const bool fwd = op == static_cast<int>(Op::kSendActivation);
      if (!received_.count(key(fwd ? Op::kRecvActivation : Op::kRecvGradient, fwd ? st + 1 : st - 1, mb))) {
        return std::string("a send of ") + (fwd ? "activation" : "gradient") + " of stage " + std::to_string(st) +
               " microbatch " + std::to_string(mb) + " is never received";
      }
    }
    for (int st = 0; st < s_.stages(); ++st) {
      for (int mb = 0; mb < s_.microbatches; ++mb) {
        const bool fwd = end_of(Op::kForward, st, mb) >= 0;
        const bool full = end_of(Op::kBackward, st, mb) >= 0;
        const bool split = end_of(Op::kBackwardInput, st, mb) >= 0 && end_of(Op::kBackwardWeight, st, mb) >= 0;
        if (!fwd || (!full && !split)) {
          return "stage " + std::to_string(st) + " microbatch " + std::to_string(mb) + " is not run both ways";
        }
      }
    }
    return "";
  }

  const std::vector<RankActions>& lists_;
  const PipelineShape& s_;
  const ActionCosts costs_;
  const int R_;
  Simulation sim_;
  std::map<Key, int64_t> done_;  // compute (op, stage, mb) -> end slot
  std::map<Key, int64_t> sent_;  // (send op, stage, mb) -> slot
  std::set<Key> received_;       // (recv op, stage, mb) a rank has received
  std::vector<size_t> pc_;       // each rank's next action
  std::vector<int64_t> clock_;   // each rank's next free slot
};

}  // namespace

Simulation simulate(const std::vector<RankActions>& lists, const PipelineShape& s, const ActionCosts& costs) {
  return Simulator(lists, s, costs).run();
}

}  // namespace composer::parallel

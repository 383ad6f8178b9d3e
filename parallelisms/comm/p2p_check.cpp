#include "parallelisms/comm/p2p_check.h"

#include <algorithm>
#include <deque>
#include <tuple>

namespace composer::parallel {
namespace {

// An operation's place: rank, communicator, group and index in the group.
struct OpRef {
  int rank = -1;
  std::string comm;
  int group = -1;
  size_t index = 0;
};

struct GroupState {
  const P2PEvent* issue = nullptr;
  std::vector<OpRef> partner;  // per operation: the operation it is matched to
  std::vector<bool> done;
  bool completed = false;
};

std::string describe(const P2PRecord& op) {
  return (op.label.empty() ? std::string(op.send ? "send" : "receive") : op.label) + (op.send ? " to rank " : " from rank ") +
         std::to_string(op.peer);
}

class Checker {
 public:
  explicit Checker(const std::map<int, P2PLog>& logs) : logs_(logs) {}

  P2PCheck run() {
    P2PCheck out;
    if (!(out.report = index_groups(out)).empty()) return out;
    if (!(out.report = match()).empty()) return out;
    for (auto& [rank, log] : logs_) pc_[rank] = 0;
    for (bool progress = true; progress;) {
      progress = false;
      for (const auto& [rank, log] : logs_) progress = advance_host(rank) || progress;
      progress = progress_streams() || progress;
    }
    out.report = stuck();
    out.ok = out.report.empty();
    return out;
  }

 private:
  using StreamKey = std::pair<int, std::string>;  // (rank, communicator)

  GroupState& state(int rank, const std::string& comm, int group) { return groups_[{rank, comm}][group]; }

  // Numbers every group, checks each wait names an issued group.
  std::string index_groups(P2PCheck& out) {
    for (const auto& [rank, log] : logs_) {
      for (const P2PEvent& e : log) {
        auto& per = groups_[{rank, e.comm}];
        if (e.kind == P2PEvent::kIssue) {
          if (e.group != static_cast<int>(per.size())) {
            return "rank " + std::to_string(rank) + " numbers its groups on " + e.comm + " out of order";
          }
          per.push_back({&e, std::vector<OpRef>(e.ops.size()), std::vector<bool>(e.ops.size(), false), false});
          ++out.groups;
          out.ops += static_cast<int64_t>(e.ops.size());
        } else if (e.group >= static_cast<int>(per.size())) {
          return "rank " + std::to_string(rank) + " waits for group " + std::to_string(e.group) + " on " + e.comm +
                 " before issuing it";
        }
      }
    }
    return "";
  }

  // The k-th send from a to b meets the k-th receive from a at b, per communicator.
  std::string match() {
    using Pair = std::tuple<std::string, int, int>;  // (comm, from, to)
    std::map<Pair, std::deque<OpRef>> sends, recvs;
    for (const auto& [rank, log] : logs_) {
      for (const P2PEvent& e : log) {
        if (e.kind != P2PEvent::kIssue) continue;
        for (size_t i = 0; i < e.ops.size(); ++i) {
          const P2PRecord& op = e.ops[i];
          if (!logs_.count(op.peer)) {
            return "rank " + std::to_string(rank) + "'s " + describe(op) + " names a rank with no sequence";
          }
          OpRef ref{rank, e.comm, e.group, i};
          (op.send ? sends[{e.comm, rank, op.peer}] : recvs[{e.comm, op.peer, rank}]).push_back(ref);
        }
      }
    }
    for (auto& [pair, queue] : sends) {
      auto& other = recvs[pair];
      for (size_t k = 0; k < queue.size(); ++k) {
        const OpRef& s = queue[k];
        const P2PRecord& sop = op_of(s);
        if (k >= other.size()) {
          return "rank " + std::to_string(s.rank) + "'s " + describe(sop) + " on " + s.comm + " is never received";
        }
        const OpRef& r = other[k];
        const P2PRecord& rop = op_of(r);
        if (sop.bytes && rop.bytes && sop.bytes != rop.bytes) {
          return "rank " + std::to_string(s.rank) + "'s " + describe(sop) + " moves " + std::to_string(sop.bytes) +
                 " bytes but is matched to rank " + std::to_string(r.rank) + "'s " + describe(rop) + " of " +
                 std::to_string(rop.bytes);
        }
        if (sop.tag != rop.tag) {  // NCCL would deliver it, into the buffer of another message
          return "rank " + std::to_string(s.rank) + "'s " + describe(sop) + " on " + s.comm + " is matched by order to rank " +
                 std::to_string(r.rank) + "'s " + describe(rop) + ", which waits for another message";
        }
        state(s.rank, s.comm, s.group).partner[s.index] = r;
        state(r.rank, r.comm, r.group).partner[r.index] = s;
      }
      if (other.size() > queue.size()) {
        const OpRef& r = other[queue.size()];
        return "rank " + std::to_string(r.rank) + "'s " + describe(op_of(r)) + " on " + r.comm + " is never sent";
      }
    }
    for (auto& [pair, queue] : recvs) {
      if (!sends.count(pair) && !queue.empty()) {
        const OpRef& r = queue.front();
        return "rank " + std::to_string(r.rank) + "'s " + describe(op_of(r)) + " on " + r.comm + " is never sent";
      }
    }
    return "";
  }

  const P2PRecord& op_of(const OpRef& r) { return state(r.rank, r.comm, r.group).issue->ops[r.index]; }

  // Issues until a wait for a group not yet complete.
  bool advance_host(int rank) {
    const P2PLog& log = logs_.at(rank);
    bool moved = false;
    for (size_t& pc = pc_[rank]; pc < log.size(); ++pc, moved = true) {
      const P2PEvent& e = log[pc];
      if (e.kind == P2PEvent::kIssue) {
        streams_[{rank, e.comm}].push_back(e.group);
      } else if (!state(rank, e.comm, e.group).completed) {
        break;
      }
    }
    return moved;
  }

  bool started(const OpRef& r) {
    auto it = streams_.find({r.rank, r.comm});
    return it != streams_.end() && !it->second.empty() && it->second.front() == r.group;
  }

  // Completes what the started groups can: each operation whose partner's
  // group has started, then each group whose operations all have.
  bool progress_streams() {
    bool moved = false;
    for (auto& [key, queue] : streams_) {
      if (queue.empty()) continue;
      GroupState& g = state(key.first, key.second, queue.front());
      for (size_t i = 0; i < g.done.size(); ++i) {
        if (g.done[i] || !started(g.partner[i])) continue;
        g.done[i] = true;
        const OpRef& p = g.partner[i];
        state(p.rank, p.comm, p.group).done[p.index] = true;
        moved = true;
      }
    }
    for (auto& [key, queue] : streams_) {
      while (!queue.empty()) {
        GroupState& g = state(key.first, key.second, queue.front());
        if (std::find(g.done.begin(), g.done.end(), false) != g.done.end()) break;
        g.completed = true;
        queue.pop_front();
        moved = true;
      }
    }
    return moved;
  }

  // The ranks left waiting and what each started group waits for, or "".
  std::string stuck() {
    std::string out;
    for (const auto& [rank, log] : logs_) {
      const size_t pc = pc_.at(rank);
      if (pc < log.size()) {
        out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(rank) + " waits for its group " +
               std::to_string(log[pc].group) + " on " + log[pc].comm;
      }
    }
    for (auto& [key, queue] : streams_) {
      if (queue.empty()) continue;
      GroupState& g = state(key.first, key.second, queue.front());
      for (size_t i = 0; i < g.done.size(); ++i) {
        if (g.done[i]) continue;
        const OpRef& p = g.partner[i];
        const P2PRecord& op = g.issue->ops[i];
        out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(key.first) + "'s " + describe(op) +
               " waits for rank " + std::to_string(p.rank) + "'s " + describe(op_of(p)) + ", " + where(p);
        break;  // one operation per stream says enough
      }
    }
    return out.empty() ? "" : "deadlock: " + out;
  }

  // Why a partner's group has not started: behind which group, or not issued.
  std::string where(const OpRef& p) {
    auto it = streams_.find({p.rank, p.comm});
    if (it == streams_.end() || std::find(it->second.begin(), it->second.end(), p.group) == it->second.end()) {
      return "which that rank has not issued";
    }
    GroupState& head = state(p.rank, p.comm, it->second.front());
    std::string ops;
    for (const P2PRecord& op : head.issue->ops) ops += (ops.empty() ? "" : ", ") + describe(op);
    return "queued behind its group [" + ops + "]";
  }

  const std::map<int, P2PLog>& logs_;
  std::map<StreamKey, std::vector<GroupState>> groups_;
  std::map<StreamKey, std::deque<int>> streams_;  // issued, not completed, in order
  std::map<int, size_t> pc_;
};

}  // namespace

P2PCheck check_p2p(const std::map<int, P2PLog>& logs) { return Checker(logs).run(); }

}  // namespace composer::parallel

#include "parallelisms/pipeline/p2p_program.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "parallelisms/comm/p2p_check.h"

namespace composer::parallel {
namespace {

bool is_recv(Op op) { return op == Op::kRecvActivation || op == Op::kRecvGradient; }
bool is_send(Op op) { return op == Op::kSendActivation || op == Op::kSendGradient; }

// Per action: the receives posted when it starts (a compute action posts
// those up to the next compute action).
std::vector<std::vector<size_t>> early_receives(const RankActions& mine) {
  std::vector<std::vector<size_t>> early(mine.size());
  for (size_t i = 0, compute = mine.size(); i < mine.size(); ++i) {
    if (is_recv(mine[i].op)) {
      if (compute < mine.size()) early[compute].push_back(i);
    } else if (!is_send(mine[i].op)) {
      compute = i;
    }
  }
  return early;
}

P2PProgram posted_program(const RankActions& mine) {
  const auto early = early_receives(mine);
  P2PProgram out;
  std::map<size_t, int> posted;  // receive action -> its group
  std::vector<int> sends;
  int groups = 0;
  auto issue = [&](const Action& a) {
    out.push_back({P2PStep::kIssue, {}, {a}, groups});
    return groups++;
  };
  for (size_t i = 0; i < mine.size(); ++i) {
    const Action& a = mine[i];
    if (is_recv(a.op)) {
      const int g = posted.count(i) ? posted[i] : issue(a);
      out.push_back({P2PStep::kWait, {}, {}, g});
    } else if (is_send(a.op)) {
      sends.push_back(issue(a));
    } else {
      for (size_t r : early[i]) posted[r] = issue(mine[r]);
      out.push_back({P2PStep::kCompute, a, {}, 0});
    }
  }
  for (int g : sends) out.push_back({P2PStep::kWait, {}, {}, g});
  return out;
}

// A message, named by its send: (send op, stage, microbatch).
using Message = std::tuple<Op, int, int>;
Message message_of(const Action& a) {
  if (a.op == Op::kRecvActivation) return {Op::kSendActivation, a.stage - 1, a.microbatch};
  if (a.op == Op::kRecvGradient) return {Op::kSendGradient, a.stage + 1, a.microbatch};
  return {a.op, a.stage, a.microbatch};
}

// The slot each message is sent at, with every compute action one slot long:
// each rank runs its list in order, a receive waits for its send's slot.
std::map<Message, int64_t> send_slots(const std::vector<RankActions>& lists) {
  std::map<Message, int64_t> sent;
  std::vector<size_t> pc(lists.size(), 0);
  std::vector<int64_t> clock(lists.size(), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < lists.size(); ++r) {
      for (; pc[r] < lists[r].size(); ++pc[r], progress = true) {
        const Action& a = lists[r][pc[r]];
        if (is_recv(a.op)) {
          auto it = sent.find(message_of(a));
          if (it == sent.end()) break;
          clock[r] = std::max(clock[r], it->second);
        } else if (is_send(a.op)) {
          sent[message_of(a)] = clock[r];
        } else {
          ++clock[r];
        }
      }
    }
  }
  for (size_t r = 0; r < lists.size(); ++r) {
    TORCH_INTERNAL_ASSERT(pc[r] == lists[r].size(), "pipeline rank ", r, " waits at ", lists[r][pc[r]].str(),
                          " for a send that never comes");
  }
  return sent;
}

// Every send and receive goes in the group of the slot its message is sent
// at; each rank issues its groups in slot order, each before the compute
// actions of that slot and after those of the slots before. The groups of one
// slot pair only with each other, so every group completes once the groups
// and computes before its slot have (by induction over the slots); within a
// group, sends to a peer and receives from it are in message order on both
// sides, so each is matched to its own message.
P2PProgram grouped_program(const RankActions& mine, const std::map<Message, int64_t>& sent) {
  std::map<int64_t, std::vector<Action>> by_slot;
  for (const Action& a : mine) {
    if (is_recv(a.op) || is_send(a.op)) by_slot[sent.at(message_of(a))].push_back(a);
  }
  P2PProgram out;
  std::map<int64_t, int> group_of;  // slot -> group
  std::vector<int> unwaited;
  auto issue_through = [&](int64_t slot) {
    while (!by_slot.empty() && by_slot.begin()->first <= slot) {
      auto node = by_slot.extract(by_slot.begin());
      std::vector<Action>& ops = node.mapped();
      std::stable_sort(ops.begin(), ops.end(), [](const Action& x, const Action& y) {
        return std::make_tuple(is_send(x.op), message_of(x)) < std::make_tuple(is_send(y.op), message_of(y));
      });
      const int g = static_cast<int>(group_of.size());
      group_of[node.key()] = g;
      out.push_back({P2PStep::kIssue, {}, ops, g});
      unwaited.push_back(g);
    }
  };
  auto wait = [&](int g) {
    auto it = std::find(unwaited.begin(), unwaited.end(), g);
    if (it == unwaited.end()) return;
    unwaited.erase(it);
    out.push_back({P2PStep::kWait, {}, {}, g});
  };
  // This rank's compute slots, as send_slots ran them.
  int64_t clock = 0;
  for (const Action& a : mine) {
    if (is_recv(a.op)) {
      clock = std::max(clock, sent.at(message_of(a)));
      issue_through(clock);
      wait(group_of.at(sent.at(message_of(a))));  // the compute after it needs it
    } else if (!is_send(a.op)) {
      issue_through(clock);
      out.push_back({P2PStep::kCompute, a, {}, 0});
      ++clock;
    }
  }
  issue_through(std::numeric_limits<int64_t>::max());
  for (int g : std::vector<int>(unwaited)) wait(g);
  return out;
}

}  // namespace

P2POrder p2p_order_for(const std::string& backend) { return backend == "nccl" ? P2POrder::kGrouped : P2POrder::kPosted; }

std::vector<P2PProgram> p2p_programs(const std::vector<RankActions>& with_comm, P2POrder order) {
  std::map<Message, int64_t> sent;
  if (order == P2POrder::kGrouped) sent = send_slots(with_comm);
  std::vector<P2PProgram> out;
  for (const RankActions& mine : with_comm) {
    out.push_back(order == P2POrder::kGrouped ? grouped_program(mine, sent) : posted_program(mine));
  }
  return out;
}

RankActions evaluation_actions(const PipelineShape& shape, int rank) {
  RankActions out;
  const int last = shape.stages() - 1;
  for (int mb = 0; mb < shape.microbatches; ++mb) {
    for (int s = 0; s <= last; ++s) {
      if (shape.rank_of(s) != rank) continue;
      if (s > 0 && shape.rank_of(s - 1) != rank) out.push_back({Op::kRecvActivation, s, mb});
      out.push_back({Op::kForward, s, mb});
      if (s < last && shape.rank_of(s + 1) != rank) out.push_back({Op::kSendActivation, s, mb});
    }
  }
  return out;
}

int p2p_peer(const Action& a, const PipelineShape& shape) {
  const bool toward_next = a.op == Op::kSendActivation || a.op == Op::kRecvGradient;
  return shape.rank_of(a.stage + (toward_next ? 1 : -1));
}

int p2p_tag(const Action& a, const PipelineShape& shape) {
  const auto [op, stage, mb] = message_of(a);
  return (static_cast<int>(op) * shape.stages() + stage) * shape.microbatches + mb + 1;
}

P2PLog program_log(const P2PProgram& program, const PipelineShape& shape, const std::vector<int>& ranks,
                   const std::string& comm) {
  P2PLog log;
  for (const P2PStep& step : program) {
    if (step.kind == P2PStep::kCompute) continue;
    P2PEvent e{step.kind == P2PStep::kIssue ? P2PEvent::kIssue : P2PEvent::kWait, comm, step.group, {}};
    for (const Action& a : step.comm) {
      e.ops.push_back({is_send(a.op), ranks.at(p2p_peer(a, shape)), 0, p2p_tag(a, shape), a.str()});
    }
    log.push_back(std::move(e));
  }
  return log;
}

std::string check_schedule_p2p(ScheduleKind kind, const PipelineShape& shape, P2POrder order) {
  const auto training_lists = with_communication(compute_schedule(kind, shape), shape);
  std::vector<RankActions> evaluation_lists;
  std::vector<int> ranks;
  for (int r = 0; r < shape.pp; ++r) {
    ranks.push_back(r);
    evaluation_lists.push_back(evaluation_actions(shape, r));
  }
  for (const bool training : {true, false}) {
    const auto& lists = training ? training_lists : evaluation_lists;
    const std::vector<P2PProgram> programs = p2p_programs(lists, order);
    std::map<int, P2PLog> logs;
    for (int r = 0; r < shape.pp; ++r) logs[r] = program_log(programs[r], shape, ranks, "pp");
    const P2PCheck check = check_p2p(logs);
    if (!check.ok) return (training ? "training: " : "evaluation: ") + check.report;
  }
  return "";
}

}  // namespace composer::parallel

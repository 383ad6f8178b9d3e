// The order a pipeline rank issues its sends and receives in, as data: the
// runtime (Pipeline::run and evaluate) executes these programs step by step,
// and the checker of NCCL's rules (parallelisms/comm/p2p_check.h) reads the
// same programs, every rank's, to prove a schedule cannot hang before a GPU
// runs it.
#pragma once
#include <string>
#include <vector>

#include "parallelisms/comm/p2p.h"
#include "parallelisms/pipeline/schedule.h"

namespace composer::parallel {

enum class P2POrder {
  // Gloo: each receive posted alone, ahead of the compute action before the
  // one that needs it (it moves while that computes), each send alone after
  // its compute. Messages are matched by tag, so no order can hang.
  kPosted,
  // NCCL: groups by the slot each message is sent at (every compute action
  // one slot long): each rank issues its sends and the receives of the
  // messages sent to it in that slot as one group, slot by slot, so a receive
  // is posted as its send is and every group meets its peers' groups of the
  // same slot. NCCL matches by order on one stream per rank; a receive posted
  // ahead of a send it depends on would wait forever.
  kGrouped,
};
// The order for a group's backend: grouped on NCCL, posted elsewhere.
P2POrder p2p_order_for(const std::string& backend);

struct P2PStep {
  enum Kind { kCompute, kIssue, kWait } kind = kCompute;
  Action action{};            // kCompute: the action
  std::vector<Action> comm;   // kIssue: the group's sends and receives
  int group = 0;              // kIssue, kWait: the group's number on this rank
};
using P2PProgram = std::vector<P2PStep>;

// Every rank's program, from every rank's action list (with communication,
// see with_communication): every send and receive in exactly one group, every
// group waited for (a receive before its compute, sends by the end).
std::vector<P2PProgram> p2p_programs(const std::vector<RankActions>& with_comm, P2POrder order);

// Forward only, for evaluation: every microbatch through every stage in
// order (microbatch, then stage), with the receives and sends its stages on
// other ranks need, as a list with communication.
RankActions evaluation_actions(const PipelineShape& shape, int rank);

// A send or receive action's peer (a pp rank) and its message's tag: a
// receive carries the tag of the send it meets.
int p2p_peer(const Action& a, const PipelineShape& shape);
int p2p_tag(const Action& a, const PipelineShape& shape);

// A program as the checker reads it: the pp group's ranks `ranks` (global,
// by pp rank) on communicator `comm`, byte counts unknown.
P2PLog program_log(const P2PProgram& program, const PipelineShape& shape, const std::vector<int>& ranks,
                   const std::string& comm);

// Every rank's training and evaluation programs in `order`, checked against
// NCCL's rules: "" when none can hang, else the checker's report.
std::string check_schedule_p2p(ScheduleKind kind, const PipelineShape& shape, P2POrder order);

}  // namespace composer::parallel

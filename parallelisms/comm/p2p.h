// Point-to-point groups: the sends and receives that must progress together
// issued as one NCCL group (c10d's coalescing, as PyTorch's batch_isend_irecv
// does), and a recorder of every rank's issue sequence for the checker of
// NCCL's matching rules (parallelisms/comm/p2p_check.h). Over Gloo a group is
// its operations posted one by one in the order given, matched by tag.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "parallelisms/comm/collectives.h"

namespace composer::parallel {

struct P2POp {
  bool send = true;     // false: a receive into `tensor`
  torch::Tensor tensor;
  int peer = 0;         // a group rank
  int tag = 0;          // Gloo's matching key (NCCL matches by order)
  std::string label;    // what it carries, for the checker's report: "SEND_F1.0"
};

// Issues `ops` on `g` as one group; the handle's wait() finishes every one of
// them (a receive's tensor holds its data then). On NCCL no operation of the
// group waits for another: a send and a receive between the same two ranks
// in opposite directions cannot block each other.
Handle issue_group(Group& g, const std::vector<P2POp>& ops);

// One operation of a recorded group: the checker's view.
struct P2PRecord {
  bool send = true;
  int peer = 0;       // the peer's global rank
  int64_t bytes = 0;  // 0: not known (a schedule's program, before shapes)
  int tag = 0;        // the message's identity: a send and the receive it meets carry the same
  std::string label;
};

// One event of a rank's sequence: a group issued on a communicator, or the
// host waiting for one. Groups are numbered per rank and communicator in
// issue order.
struct P2PEvent {
  enum Kind { kIssue, kWait } kind = kIssue;
  std::string comm;  // the communicator: the group's name and global ranks, "pp[0,1]"
  int group = 0;
  std::vector<P2PRecord> ops;  // kIssue
};
using P2PLog = std::vector<P2PEvent>;


// While alive, every issue_group on this thread appends its group to the log,
// and each of its handles' wait() a wait: the sequence the code issued, as
// the checker reads it.
class P2PRecorder {
 public:
  P2PRecorder();
  ~P2PRecorder();
  P2PRecorder(const P2PRecorder&) = delete;
  P2PRecorder& operator=(const P2PRecorder&) = delete;
  const P2PLog& log() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<State> outer_;  // a recorder this one hides while alive
};

}  // namespace composer::parallel

// A model of NCCL's point-to-point rules, run over every rank's issued
// sequence (P2PLog) to prove that the sequence cannot hang on NCCL, or to say
// which ranks and operations would wait on each other. The rules modelled:
//
// - a rank issues its events in order; a wait blocks its host until the group
//   has completed (on NCCL a wait only orders the compute stream, which blocks
//   nothing the host issues later: a proof with blocking waits holds for both);
// - every group of one communicator runs on one stream per rank, in issue order:
//   a group starts once every group issued before it there has completed;
// - the k-th send from rank a to rank b on a communicator is matched to the
//   k-th receive from a that b issues there, whatever groups hold them; the
//   two must carry the same message (tag) and bytes, or the data would land
//   in another message's buffer;
// - a started group's operations progress together (ncclGroupStart/End), each
//   completing once its matched operation's group has started too; no message
//   is buffered ahead of its receive (NCCL_BUFFSIZE hides small ones, which is
//   not a guarantee); a group completes when all its operations have.
#pragma once
#include <map>
#include <string>

#include "parallelisms/comm/p2p.h"

namespace composer::parallel {

struct P2PCheck {
  bool ok = false;
  std::string report;  // why not: a deadlock with the ranks and operations involved, or an unmatched operation
  int64_t groups = 0;  // groups issued over all ranks
  int64_t ops = 0;     // operations in them
};

// Every rank's sequence, by global rank.
P2PCheck check_p2p(const std::map<int, P2PLog>& logs);

}  // namespace composer::parallel

#include "parallelisms/comm/p2p.h"

#include <map>

#include "parallelisms/comm/flight_recorder.h"

namespace composer::parallel {

struct P2PRecorder::State {
  P2PLog log;
  std::map<std::string, int> groups;  // per communicator: groups issued so far
};

namespace {

thread_local std::shared_ptr<P2PRecorder::State> recording;

int64_t nbytes(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Appends the issue of `ops` on `g`; returns the wait's recorder (none when not recording).
std::function<void()> record_issue(const Group& g, const std::vector<P2POp>& ops) {
  if (!recording) return nullptr;
  auto state = recording;
  const std::string comm = comm_key(g);
  P2PEvent e{P2PEvent::kIssue, comm, state->groups[comm]++, {}};
  for (const P2POp& op : ops) e.ops.push_back({op.send, g.ranks.at(op.peer), nbytes(op.tensor), op.tag, op.label});
  state->log.push_back(e);
  return [state, comm = e.comm, group = e.group] { state->log.push_back({P2PEvent::kWait, comm, group, {}}); };
}

bool nccl(const Group& g) { return g.pg && g.pg->getBackendName() == "nccl"; }

}  // namespace

Handle issue_group(Group& g, const std::vector<P2POp>& ops) {
  std::function<void()> waited = record_issue(g, ops);
  // Each operation through send()/recv(): their counters, delay points and
  // host or device copies. Inside NCCL's group they return no work of their
  // own; the group's one work completes them all.
  const bool grouped = nccl(g);
  if (grouped) g.pg->startCoalescing();
  std::vector<Handle> each;
  for (const P2POp& op : ops) {
    torch::Tensor t = op.tensor;
    CommSite site(op.label);  // the flight recorder names the action: "SEND_F1.0"
    each.push_back(op.send ? send(g, t, op.peer, op.tag, /*async=*/true) : recv(g, t, op.peer, op.tag, /*async=*/true));
  }
  c10::intrusive_ptr<c10d::Work> work = grouped ? g.pg->endCoalescing() : c10::intrusive_ptr<c10d::Work>();
  return Handle(work, [each = std::move(each), waited]() mutable {
    for (Handle& h : each) h.wait();
    if (waited) waited();
  });
}

P2PRecorder::P2PRecorder() : state_(std::make_shared<State>()), outer_(recording) { recording = state_; }
P2PRecorder::~P2PRecorder() { recording = outer_; }
const P2PLog& P2PRecorder::log() const { return state_->log; }

}  // namespace composer::parallel

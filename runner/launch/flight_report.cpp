#include "runner/launch/flight_report.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <tuple>

namespace composer {
namespace {

using parallel::FlightRecord;

// "all_reduce (4096 B float, grad norm)": an operation as a finding names it.
std::string describe(const FlightRecord& r) {
  std::string s = std::string(r.kind) + " (" + std::to_string(r.bytes) + " B " + r.dtype;
  if (r.site[0]) s += ", " + std::string(r.site);
  s += ", step " + std::to_string(r.step) + ")";
  return s;
}

// The global ranks of a communicator's name: "dp[0,2]" -> {0, 2}.
std::vector<int> members_of(const std::string& group) {
  std::vector<int> out;
  const size_t open = group.rfind('[');
  if (open == std::string::npos) return out;
  int v = 0;
  bool digits = false;
  for (size_t i = open + 1; i < group.size(); ++i) {
    const char ch = group[i];
    if (ch >= '0' && ch <= '9') {
      v = v * 10 + (ch - '0');
      digits = true;
    } else if (digits) {
      out.push_back(v);
      v = 0;
      digits = false;
    }
  }
  return out;
}

// One rank's operations on one channel (a group's collectives, or its sends
// or receives to one peer), by sequence number.
using Channel = std::map<uint64_t, const FlightRecord*>;

struct Rings {
  std::map<int, const RankFlight*> by_rank;
  // group -> rank -> collectives
  std::map<std::string, std::map<int, Channel>> collectives;
  // (group, sender, receiver) -> the sender's sends, the receiver's receives
  std::map<std::tuple<std::string, int, int>, std::pair<Channel, Channel>> p2p;
};

Rings index(const std::vector<RankFlight>& ranks) {
  Rings x;
  for (const auto& rf : ranks) {
    x.by_rank[rf.rank] = &rf;
    for (const auto& r : rf.records) {
      if (r.peer < 0) {
        x.collectives[r.group][rf.rank][r.seq] = &r;
      } else if (std::string(r.kind) == "send") {
        x.p2p[{r.group, rf.rank, r.peer}].first[r.seq] = &r;
      } else {
        x.p2p[{r.group, r.peer, rf.rank}].second[r.seq] = &r;
      }
    }
  }
  return x;
}

uint64_t last_seq(const Channel& c) { return c.empty() ? 0 : c.rbegin()->first; }

// The same collective on two ranks: its kind, dtype and bytes, except an all_to_all's, whose ranks each send
// their own counts (expert_parallel's routed rows).
bool same_operation(const FlightRecord& a, const FlightRecord& b) {
  const std::string kind = a.kind;
  return kind == b.kind && (a.bytes == b.bytes || kind == "all_to_all") && std::string(a.dtype) == b.dtype;
}

// Two ranks that issued different collectives under one sequence number of a
// group: the smallest such number on each group.
void mismatches(const Rings& x, std::vector<std::string>& out) {
  for (const auto& [group, ranks] : x.collectives) {
    if (ranks.size() < 2) continue;
    uint64_t first = UINT64_MAX;
    std::string line;
    for (auto a = ranks.begin(); a != ranks.end(); ++a) {
      for (auto b = std::next(a); b != ranks.end(); ++b) {
        for (const auto& [seq, ra] : a->second) {
          auto it = b->second.find(seq);
          if (it == b->second.end() || same_operation(*ra, *it->second) || seq >= first) continue;
          first = seq;
          line = "mismatch on " + group + " at collective #" + std::to_string(seq) + ": rank " +
                 std::to_string(a->first) + " issued " + describe(*ra) + ", rank " + std::to_string(b->first) +
                 " issued " + describe(*it->second);
          break;
        }
      }
    }
    if (!line.empty()) out.push_back(line);
  }
}

// A rank behind a peer: `rank` has not issued what `waiter` waits for; `text`
// says where and on what, after "rank R ".
struct Behind {
  int rank = 0;
  int waiter = 0;
  bool blocked = false;  // the waiter is inside a wait for it (not only posted ahead)
  std::string text;
};

bool blocked_in(const FlightRecord* r) { return r && r->waited_ns != 0 && r->finished_ns == 0; }

// Ranks that issued fewer collectives on a group than a peer did: the first
// one they have not issued, as the peer recorded it.
void collectives_behind(const Rings& x, std::vector<Behind>& out) {
  for (const auto& [group, ranks] : x.collectives) {
    uint64_t most = 0;
    int leader = -1;
    for (const auto& [rank, ch] : ranks) {
      if (last_seq(ch) > most) most = last_seq(ch), leader = rank;
    }
    for (int member : members_of(group)) {
      auto it = ranks.find(member);
      if (!x.by_rank.count(member)) continue;  // its ring is not there: nothing to say about it
      const uint64_t issued = it == ranks.end() ? 0 : last_seq(it->second);
      if (issued >= most) continue;
      const FlightRecord* next = nullptr;
      auto lead = ranks.at(leader).find(issued + 1);
      if (lead != ranks.at(leader).end()) next = lead->second;
      out.push_back({member, leader, blocked_in(next),
                     "on " + group + ": it issued " + std::to_string(issued) + " collectives there, rank " +
                         std::to_string(leader) + " issued " + std::to_string(most) +
                         (next ? "; the first it has not issued: #" + std::to_string(issued + 1) + " " + describe(*next)
                               : std::string())});
    }
  }
}

// A receive with no send issued for it, or a send no receive was posted for.
void p2p_behind(const Rings& x, std::vector<Behind>& out, std::vector<std::string>& mismatched) {
  for (const auto& [key, chans] : x.p2p) {
    const auto& [group, sender, receiver] = key;
    const Channel& sends = chans.first;
    const Channel& recvs = chans.second;
    const bool have_sender = x.by_rank.count(sender), have_receiver = x.by_rank.count(receiver);
    const uint64_t sent = last_seq(sends), received = last_seq(recvs);
    if (have_sender && received > sent) {
      auto w = recvs.find(sent + 1);
      const FlightRecord& want = w != recvs.end() ? *w->second : *recvs.rbegin()->second;
      out.push_back({sender, receiver, blocked_in(&want),
                     "on " + group + ": rank " + std::to_string(receiver) + " waits in recv #" +
                         std::to_string(sent + 1) + " from it " + describe(want) +
                         ", which it has not issued; its last send to rank " + std::to_string(receiver) + " is #" +
                         std::to_string(sent)});
    } else if (have_receiver && sent > received) {
      auto w = sends.find(received + 1);
      const FlightRecord& want = w != sends.end() ? *w->second : *sends.rbegin()->second;
      out.push_back({receiver, sender, blocked_in(&want),
                     "on " + group + ": rank " + std::to_string(sender) + " sends #" + std::to_string(received + 1) +
                         " to it " + describe(want) + ", for which it has posted no receive; its last receive from "
                         "rank " + std::to_string(sender) + " is #" + std::to_string(received)});
    }
    for (const auto& [seq, s] : sends) {  // the same message with two sizes
      auto r = recvs.find(seq);
      if (r != recvs.end() && s->bytes != r->second->bytes) {
        mismatched.push_back("mismatch on " + group + " at message #" + std::to_string(seq) + " from rank " +
                      std::to_string(sender) + " to rank " + std::to_string(receiver) + ": send " + describe(*s) +
                      ", recv " + describe(*r->second));
        break;
      }
    }
  }
}

// Nobody is behind on what the ranks issued, but a rank waits inside an
// operation its peer issued and has not completed while that peer waits in
// none (it is stopped, or computing): the peer holds the transfer up.
void stuck_transfers(const Rings& x, std::vector<std::string>& out) {
  std::set<int> waiting;
  for (const auto& [rank, rf] : x.by_rank) {
    for (const auto& r : rf->records) {
      if (blocked_in(&r)) waiting.insert(rank);
    }
  }
  std::set<int> named;
  auto name = [&](int peer, const FlightRecord& theirs, int waiter, const FlightRecord& mine) {
    if (waiting.count(peer) || named.count(peer) || theirs.finished_ns != 0) return;
    named.insert(peer);
    out.push_back("rank " + std::to_string(peer) + " is behind on " + theirs.group + ": it has not completed #" +
                  std::to_string(theirs.seq) + " " + describe(theirs) + ", in which rank " + std::to_string(waiter) +
                  " waits (#" + std::to_string(mine.seq) + " " + describe(mine) +
                  "), and it waits in no operation itself (stopped, or computing)");
  };
  for (const auto& [key, chans] : x.p2p) {
    const auto& [group, sender, receiver] = key;
    for (const auto& [seq, r] : chans.second) {  // the receiver waits in it
      auto s = chans.first.find(seq);
      if (blocked_in(r) && s != chans.first.end()) name(sender, *s->second, receiver, *r);
    }
    for (const auto& [seq, snd] : chans.first) {  // the sender waits in it
      auto r = chans.second.find(seq);
      if (blocked_in(snd) && r != chans.second.end()) name(receiver, *r->second, sender, *snd);
    }
  }
  for (const auto& [group, ranks] : x.collectives) {
    for (const auto& [rank, ch] : ranks) {
      for (const auto& [seq, r] : ch) {
        if (!blocked_in(r)) continue;
        for (const auto& [peer, theirs] : ranks) {
          auto t = theirs.find(seq);
          if (peer != rank && t != theirs.end()) name(peer, *t->second, rank, *r);
        }
      }
    }
  }
}

// Nobody is behind: the oldest operation still unfinished, on any rank.
void unfinished(const std::vector<RankFlight>& ranks, std::vector<std::string>& out) {
  const FlightRecord* oldest = nullptr;
  int who = -1;
  for (const auto& rf : ranks) {
    for (const auto& r : rf.records) {
      if (r.finished_ns == 0 && (!oldest || r.issued_ns < oldest->issued_ns)) oldest = &r, who = rf.rank;
    }
  }
  if (!oldest) return;
  const int64_t age = parallel::monotonic_now_ns() - oldest->issued_ns;
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", static_cast<double>(age) / 1e9);
  out.push_back("every rank issued the same operations; rank " + std::to_string(who) + " has not finished #" +
                std::to_string(oldest->seq) + " " + describe(*oldest) + " on " + oldest->group + ", issued " + secs +
                " s ago");
}

double ms_since(int64_t t, int64_t now) { return t == 0 ? 0.0 : static_cast<double>(t - now) / 1e6; }

// When a rank's ring last changed (an issue, start, wait or finish): a
// stopped rank's stops advancing.
int64_t last_advance(const RankFlight& rf) {
  int64_t t = 0;
  for (const auto& r : rf.records) t = std::max({t, r.issued_ns, r.started_ns, r.waited_ns, r.finished_ns});
  return t;
}

std::string seconds(int64_t ns) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f s", static_cast<double>(ns) / 1e9);
  return s;
}

// "rank 0", "ranks 0 and 2", "ranks 0, 2 and 3".
std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += i + 1 == ranks.size() ? " and " : ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// The operation a rank waits in (the training thread's newest first), or nullptr.
const FlightRecord* waiting_in(const RankFlight& rf) {
  const FlightRecord* best = nullptr;
  for (const auto& r : rf.records) {
    if (!blocked_in(&r)) continue;
    const bool better = !best || (r.thread == 0 && best->thread != 0) || (r.thread == best->thread && r.id > best->id);
    if (better) best = &r;
  }
  return best;
}

// Whether `theirs` on rank `peer` is `mine` on rank `me`: the same collective,
// or the other end of the same message.
bool same_op(int me, const FlightRecord& mine, int peer, const FlightRecord& theirs) {
  if (mine.seq != theirs.seq || std::string(mine.group) != theirs.group) return false;
  if (mine.peer < 0) return theirs.peer < 0;
  return mine.peer == peer && theirs.peer == me && std::string(mine.kind) != theirs.kind;
}

// The peers that wait inside the operation `op` of rank `me` too.
std::vector<int> waiting_with(const Rings& x, int me, const FlightRecord& op) {
  std::vector<int> out;
  for (const auto& [peer, rf] : x.by_rank) {
    if (peer == me) continue;
    for (const auto& r : rf->records) {
      if (blocked_in(&r) && same_op(me, op, peer, r)) {
        out.push_back(peer);
        break;
      }
    }
  }
  return out;
}

// Where a frozen rank's ring stopped: inside an operation (and who waits in
// it with it), else behind a peer that waits for it, else in none.
std::string where_frozen(const Rings& x, const RankFlight& rf, const std::vector<Behind>& behind) {
  if (const FlightRecord* op = waiting_in(rf)) {
    std::string s = "it stopped inside #" + std::to_string(op->seq) + " " + describe(*op) + " on " + op->group;
    const std::vector<int> peers = waiting_with(x, rf.rank, *op);
    if (!peers.empty()) s += ", in which " + rank_list(peers) + (peers.size() == 1 ? " waits" : " wait");
    return s;
  }
  for (bool blocked : {true, false}) {  // one a peer waits for first
    for (const auto& b : behind) {
      if (b.rank == rf.rank && b.blocked == blocked) return "it is behind " + b.text;
    }
  }
  return "it waits in no operation (it stopped while computing)";
}

// "rank 1 is frozen (...): it stopped inside ...", for each rank whose
// process the launcher saw stopped until the end.
void frozen(const std::vector<RankFlight>& ranks, const Rings& x, const std::vector<Behind>& behind,
            std::vector<std::string>& out) {
  const int64_t now = parallel::monotonic_now_ns();
  int64_t others = 0;  // the newest advance of a rank that ran
  for (const auto& rf : ranks) {
    if (!rf.stopped) others = std::max(others, last_advance(rf));
  }
  for (const auto& rf : ranks) {
    if (!rf.stopped) continue;
    const char* abbrev = sigabbrev_np(rf.stopped);
    std::string line = "rank " + std::to_string(rf.rank) + " is frozen (its process was stopped by signal " +
                       std::to_string(rf.stopped) + (abbrev ? " (SIG" + std::string(abbrev) + ")" : std::string()) +
                       " until the job ended";
    const int64_t mine = last_advance(rf);
    if (mine > 0) line += "; its ring last advanced " + seconds(now - mine) + " before this report";
    if (mine > 0 && others > 0) line += ", the other ranks' " + seconds(now - others);
    out.push_back(line + "): " + where_frozen(x, rf, behind));
  }
}

}  // namespace

// The ranks behind, those that wait for no one first: a rank behind that is
// itself inside a wait for a rank behind (a pipeline's stages, each waiting
// for the one before a frozen rank) is held up, not the cause. A receive
// posted ahead and not yet waited for holds no one up.
void order_behind(const std::vector<Behind>& behind, std::vector<std::string>& out) {
  std::map<int, int> waits_for;  // a waiter -> a rank behind it waits for
  for (const auto& b : behind) {
    if (b.blocked) waits_for.emplace(b.waiter, b.rank);
  }
  std::vector<std::string> held;
  for (const auto& b : behind) {
    if (!b.blocked) continue;  // only posted ahead: nobody waits for it yet
    auto w = waits_for.find(b.rank);
    if (w == waits_for.end()) {
      out.push_back("rank " + std::to_string(b.rank) + " is behind " + b.text);
    } else {
      held.push_back("rank " + std::to_string(b.rank) + " is held up (it waits for rank " + std::to_string(w->second) +
                     ") " + b.text);
    }
  }
  out.insert(out.end(), held.begin(), held.end());
}

std::vector<std::string> flight_findings(const std::vector<RankFlight>& ranks) {
  const Rings x = index(ranks);
  std::vector<std::string> out;
  std::vector<Behind> behind;
  mismatches(x, out);
  collectives_behind(x, behind);
  p2p_behind(x, behind, out);
  const size_t before = out.size();
  frozen(ranks, x, behind, out);
  if (out.size() > before) return out;  // the ranks behind or waiting are held up by the frozen ones
  order_behind(behind, out);
  if (out.empty()) stuck_transfers(x, out);
  if (out.empty()) unfinished(ranks, out);
  return out;
}

nlohmann::json flight_json(const RankFlight& rf, int64_t now_ns) {
  nlohmann::json ops = nlohmann::json::array();
  for (const auto& r : rf.records) {
    nlohmann::json o = {{"id", r.id},       {"seq", r.seq},     {"kind", r.kind},   {"group", r.group},
                        {"bytes", r.bytes}, {"dtype", r.dtype}, {"site", r.site},   {"step", r.step},
                        {"thread", r.thread == 0 ? "training" : "helper"},
                        {"issued_ms", ms_since(r.issued_ns, now_ns)}};
    if (r.peer >= 0) o["peer"] = r.peer;
    o["started_ms"] = r.started_ns ? nlohmann::json(ms_since(r.started_ns, now_ns)) : nlohmann::json(nullptr);
    o["finished_ms"] = r.finished_ns ? nlohmann::json(ms_since(r.finished_ns, now_ns)) : nlohmann::json(nullptr);
    ops.push_back(o);
  }
  return {{"rank", rf.rank}, {"step", rf.step}, {"operations", ops}};
}

std::vector<std::string> report_flights(const std::string& ring_dir, const std::vector<int>& ranks,
                                        const std::string& dump_dir, const std::map<int, int>& stopped) {
  std::vector<RankFlight> rings;
  for (int r : ranks) {
    RankFlight rf;
    int rank = -1;
    rf.records = parallel::FlightRecorder::read_file(ring_dir + "/flight-" + std::to_string(r) + ".bin", &rank, &rf.step);
    if (rank < 0) continue;
    rf.rank = rank;
    if (auto it = stopped.find(rank); it != stopped.end()) rf.stopped = it->second;
    rings.push_back(std::move(rf));
  }
  if (rings.empty()) return {};
  const int64_t now = parallel::monotonic_now_ns();
  std::error_code ec;
  if (!dump_dir.empty()) std::filesystem::create_directories(dump_dir, ec);
  if (!dump_dir.empty() && !ec) {
    for (const auto& rf : rings) {
      std::ofstream(dump_dir + "/rank-" + std::to_string(rf.rank) + ".json") << flight_json(rf, now).dump(1) << "\n";
    }
  }
  const std::vector<std::string> findings = flight_findings(rings);
  std::string text;
  for (const auto& f : findings) text += "flight recorder: " + f + "\n";
  if (!findings.empty() && !dump_dir.empty()) {
    text += "flight recorder: each rank's last operations are in " + dump_dir + "/rank-<r>.json\n";
  }
  std::cerr << text << std::flush;
  return findings;
}

void dump_flight(const parallel::FlightRecorder& recorder, const std::string& dump_dir) {
  std::error_code ec;
  std::filesystem::create_directories(dump_dir, ec);
  RankFlight rf;
  rf.rank = recorder.rank();
  rf.step = recorder.step();
  rf.records = recorder.records();
  std::ofstream(dump_dir + "/rank-" + std::to_string(rf.rank) + ".json")
      << flight_json(rf, parallel::monotonic_now_ns()).dump(1) << "\n";
}

}  // namespace composer

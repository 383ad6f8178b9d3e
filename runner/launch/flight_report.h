// Reading the ranks' flight recorders after a failure (parallelisms/comm/
// flight_recorder.h): which ranks are behind, on which operation, and which
// issued different operations under the same sequence number.
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "parallelisms/comm/flight_recorder.h"

namespace composer {

// One rank's ring as read back, and its process as the launcher saw it.
struct RankFlight {
  int rank = 0;
  int64_t step = 0;  // the step it was in
  std::vector<parallel::FlightRecord> records;  // oldest first
  int stopped = 0;  // the signal that held its process stopped until the job ended (SIGSTOP...); 0: it ran
};

// What the rings say, most telling first, one line each:
//   "mismatch on dp[0,1] at collective #7: rank 0 issued all_reduce (4096 B float, ...), rank 1 issued reduce_scatter (...)"
//   "rank 1 is behind on pp[0,1]: rank 0 waits in recv #3 from it (RECV_F1.0), which it has not issued; its last send to rank 0 is #2"
//   "rank 0 is behind on dp[0,1]: it issued 6 collectives there, rank 1 issued 7; the first it has not issued: #7 all_reduce (...)"
//   "rank 2 is held up (it waits for rank 1) on pp[2,3]: ...": behind, but itself inside a wait for a rank behind
//   "every rank issued the same operations; rank 1 has not finished #9 all_gather on dp[0,1] (...), issued 10.2 s before the failure"
//   "rank 1 is frozen (its process was stopped by signal 19 (SIGSTOP) ...): it stopped inside #9 all_gather (...) on dp[0,1], in which rank 0 waits"
// A rank whose process was stopped is the cause, whatever the rings show of
// the others (they wait for it, directly or through a peer): it is named,
// with where its ring stopped, and no other rank is named behind.
// Empty when the rings show nothing amiss.
std::vector<std::string> flight_findings(const std::vector<RankFlight>& ranks);

// A rank's ring as JSON: {"rank", "step", "operations": [{id, seq, kind, group, peer, bytes, dtype, site, step,
// thread, issued_ms, started_ms, finished_ms}]}, times relative to `now_ns` (negative: before it).
nlohmann::json flight_json(const RankFlight& r, int64_t now_ns);

// The launcher's part after a failed attempt: reads the rings the ranks
// mapped in `ring_dir` (flight-<rank>.bin), writes each as
// `dump_dir`/rank-<r>.json (when dump_dir is not empty) and prints the
// findings to stderr. `stopped`: rank -> the signal that held its process
// stopped until the end (the ranks the launcher saw frozen). Returns the findings.
std::vector<std::string> report_flights(const std::string& ring_dir, const std::vector<int>& ranks,
                                        const std::string& dump_dir, const std::map<int, int>& stopped = {});

// A rank's own dump when it fails under an external launcher: its ring as
// `dump_dir`/rank-<r>.json.
void dump_flight(const parallel::FlightRecorder& recorder, const std::string& dump_dir);

}  // namespace composer

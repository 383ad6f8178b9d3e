// Reading the ranks' flight recorders after a failure (parallelisms/comm/
// flight_recorder.h): which ranks are behind, on which operation, and which
// issued different operations under the same sequence number.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "parallelisms/comm/flight_recorder.h"

namespace composer {

// One rank's ring as read back.
struct RankFlight {
  int rank = 0;
  int64_t step = 0;  // the step it was in
  std::vector<parallel::FlightRecord> records;  // oldest first
};

// What the rings say, most telling first, one line each:
//   "mismatch on dp[0,1] at collective #7: rank 0 issued all_reduce (4096 B float, ...), rank 1 issued reduce_scatter (...)"
//   "rank 1 is behind on pp[0,1]: rank 0 waits in recv #3 from it (RECV_F1.0), which it has not issued; its last send to rank 0 is #2"
//   "rank 0 is behind on dp[0,1]: it issued 6 collectives there, rank 1 issued 7; the first it has not issued: #7 all_reduce (...)"
//   "rank 2 is held up (it waits for rank 1) on pp[2,3]: ...": behind, but itself inside a wait for a rank behind
//   "every rank issued the same operations; rank 1 has not finished #9 all_gather on dp[0,1] (...), issued 10.2 s before the failure"
// Empty when the rings show nothing amiss.
std::vector<std::string> flight_findings(const std::vector<RankFlight>& ranks);

// A rank's ring as JSON: {"rank", "step", "operations": [{id, seq, kind, group, peer, bytes, dtype, site, step,
// thread, issued_ms, started_ms, finished_ms}]}, times relative to `now_ns` (negative: before it).
nlohmann::json flight_json(const RankFlight& r, int64_t now_ns);

// The launcher's part after a failed attempt: reads the rings the ranks
// mapped in `ring_dir` (flight-<rank>.bin), writes each as
// `dump_dir`/rank-<r>.json (when dump_dir is not empty) and prints the
// findings to stderr. Returns the findings.
std::vector<std::string> report_flights(const std::string& ring_dir, const std::vector<int>& ranks,
                                        const std::string& dump_dir);

// A rank's own dump when it fails under an external launcher: its ring as
// `dump_dir`/rank-<r>.json.
void dump_flight(const parallel::FlightRecorder& recorder, const std::string& dump_dir);

}  // namespace composer

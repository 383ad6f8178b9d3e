// A flight recorder: each rank keeps its last K collectives and point-to-point
// operations (kind, group, sequence number, bytes, dtype, the code site, and
// when each was issued, started and finished) in a ring of fixed-size
// records. With a file the ring lives in shared memory mapped from it, so the
// launcher reads it even when the rank is frozen or was killed; without one
// it lives in the process and the rank dumps it when it fails
// (runner/launch/flight_report.h reads the rings and names the ranks behind).
//
// Sequence numbers: a collective is numbered on its group (the n-th
// collective this rank issued on "dp[0,1]"), a send or receive on its group
// and peer (the n-th send to rank 3 on "pp[1,3]"), so the same number on two
// ranks is the same operation when the code is right.
#pragma once
#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace composer::parallel {

struct Group;

// One slot of the ring, as it lies in memory and in the file.
struct FlightRecord {
  uint64_t id = 0;           // 1-based issue number on this rank; 0 = an empty slot
  uint64_t seq = 0;          // on its group (collectives) or its group, peer and direction (p2p)
  int64_t bytes = 0;         // the payload handed to the operation
  int64_t issued_ns = 0;     // CLOCK_MONOTONIC: the call reached the transport's entry
  int64_t started_ns = 0;    // handed to the backend (0: not yet)
  int64_t waited_ns = 0;     // the rank began to wait for it: at issue for a blocking one, at its
                             // handle's wait() for an asynchronous one (0: not yet)
  int64_t finished_ns = 0;   // completed, its wait returned (0: not yet)
  int64_t step = 0;          // the training step it belongs to (0: before the first)
  int32_t peer = -1;         // p2p: the peer's global rank; -1: a collective
  int32_t thread = 0;        // 0: the training thread; 1: a helper thread
  char kind[16] = {};        // "all_reduce", "send", ...
  char group[64] = {};       // the communicator: "dp[0,1]"
  char dtype[16] = {};       // "float", "bfloat16"
  char site[64] = {};        // what issued it: "SEND_F1.0", "fully_shard layers.3", "grad norm"
};

// The head of the ring's file.
struct FlightHeader {
  char magic[8] = {'C', 'F', 'L', 'I', 'G', 'H', 'T', '2'};
  int32_t rank = 0;
  int32_t capacity = 0;
  uint64_t next_id = 1;  // the id the next record gets
  int64_t step = 0;      // the step the rank is in
};

class FlightRecorder {
 public:
  // `capacity` records; `path` non-empty: the ring lives in that file (created, truncated).
  FlightRecorder(int rank, int64_t capacity, const std::string& path = "");
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // Records that this thread issues `kind` on `g` (to or from group rank
  // `peer` for a send or receive, -1 for a collective); returns its id.
  uint64_t issue(const Group& g, const char* kind, int peer, int64_t bytes, c10::ScalarType dtype);
  void started(uint64_t id);
  // An asynchronous operation: not waited for at issue (`waiting`: the wait begins now).
  void waiting(uint64_t id, bool waiting);
  void finished(uint64_t id);

  void set_step(int64_t step);
  int64_t step() const;
  int rank() const { return header_->rank; }

  // debug.inject skip_collective: the first all_reduce or reduce_scatter this
  // rank issues in `step` is skipped (not issued, not recorded).
  void skip_first_reduction_of(int64_t step) { skip_step_ = step; }
  // Whether the caller, about to issue a gradient reduction, skips it (once).
  bool skips_reduction();

  // The records in the ring, oldest first.
  std::vector<FlightRecord> records() const;
  const std::string& path() const { return path_; }

  // The records of a ring's file (a rank that may be frozen or gone); empty
  // when the file is missing or not a ring. `rank` gets the rank it names.
  static std::vector<FlightRecord> read_file(const std::string& path, int* rank = nullptr, int64_t* step = nullptr);

 private:
  FlightRecord* slot_of(uint64_t id) const;

  std::string path_;
  size_t mapped_bytes_ = 0;
  void* base_ = nullptr;  // header then capacity records (mapped, or malloc'd)
  bool mapped_ = false;
  FlightHeader* header_ = nullptr;
  FlightRecord* ring_ = nullptr;
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> seqs_;  // per group (and peer and direction)
  std::atomic<int64_t> skip_step_{-1};  // read on every reduction: no lock when nothing is to be skipped
};

// A recorded operation while it runs: marks it started and finished, and on
// the training thread adds its time to the thread's time in communication.
// Without a recorder it only keeps the time.
class FlightOp {
 public:
  FlightOp() = default;
  FlightOp(std::shared_ptr<FlightRecorder> r, uint64_t id) : r_(std::move(r)), id_(id) {}
  void started() const {
    if (r_) r_->started(id_);
  }
  void finished() const {
    if (r_) r_->finished(id_);
  }
  void waiting(bool w) const {
    if (r_) r_->waiting(id_, w);
  }

 private:
  std::shared_ptr<FlightRecorder> r_;
  uint64_t id_ = 0;
};

// The time this thread spent inside collectives and waits for them, in
// nanoseconds: nested scopes count once. The trainer reads it per step.
class CommClock {
 public:
  CommClock();
  ~CommClock();
  CommClock(const CommClock&) = delete;
  CommClock& operator=(const CommClock&) = delete;
  // This thread's total so far, and reset to zero.
  static int64_t take_ns();

 private:
  int64_t start_ = 0;
};

// While alive, operations this thread issues are recorded with `site`.
class CommSite {
 public:
  explicit CommSite(std::string site);
  ~CommSite();
  CommSite(const CommSite&) = delete;
  CommSite& operator=(const CommSite&) = delete;

 private:
  std::string outer_;
};

// Marks this thread as the training thread (records of others say thread 1).
void mark_training_thread();

int64_t monotonic_now_ns();

}  // namespace composer::parallel

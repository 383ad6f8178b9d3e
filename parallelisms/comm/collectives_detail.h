// What collectives.cpp and collectives_fused.cpp share: where a collective's
// bytes move, the record of each collective (its count, its flight-recorder
// entry, its time in communication), and rings over send/recv. Not an
// interface: only those two files include it.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "parallelisms/comm/flight_recorder.h"
#include "parallelisms/comm/mesh.h"
#include "parallelisms/comm/trace_span.h"

namespace composer::parallel {
class Handle;
}  // namespace composer::parallel

namespace composer::parallel::detail {

// Gloo sums no bfloat16 (and composer sums float16 as it sums bfloat16).
bool sixteen_bit(const torch::Tensor& t);
// The group's backend is NCCL.
bool nccl(const Group& g);
// Where a collective on `g` moves `t`'s bytes from, and whether that is not where `t` lies.
c10::Device wire_device(const Group& g, const torch::Tensor& t);
bool rewired(const Group& g, const torch::Tensor& t);
// A view of a host tensor's bytes that does not own them (collectives.cpp says when).
torch::Tensor unowned(const torch::Tensor& t);
// "all_gather dp 1048576 B": a collective's span in the profiler's trace.
std::function<std::string()> span_name(const Group& g, const char* kind, int64_t bytes);

// A collective as this rank runs it: counted in its group's counter,
// recorded in the flight recorder (finished when this goes, unless handed to
// the handle of an asynchronous one) and, when `timed`, its time counted as
// time in communication (the fused forms time only their transfers).
class Recorded {
 public:
  Recorded(Group& g, const char* kind, int64_t bytes, int64_t ring_bytes, c10::ScalarType dtype, int peer = -1,
           bool timed = true)
      : bytes_(bytes) {
    if (timed) clock_.emplace();
    g.counter->add(kind, bytes, ring_bytes);
    if (g.recorder) op_ = FlightOp(g.recorder, g.recorder->issue(g, kind, peer, bytes, dtype));
  }
  ~Recorded() {
    if (finish_) op_.finished();
  }
  Recorded(const Recorded&) = delete;
  Recorded& operator=(const Recorded&) = delete;
  // Marks the transfer handed to the backend.
  void started() const { op_.started(); }
  // An asynchronous operation's handle: the rank waits for it, and it
  // finishes, at the handle's wait() (`work`'s, then `then`).
  Handle handle(c10::intrusive_ptr<c10d::Work> work, std::function<void()> then);
  int64_t bytes() const { return bytes_; }

 private:
  std::optional<CommClock> clock_;
  FlightOp op_;
  int64_t bytes_;
  bool finish_ = true;
};

constexpr int kPiecesTag = 2 << 20;  // the blocking rings over pieces of a dim

// The bytes of one index of `dim` (of an empty piece too).
int64_t slice_bytes(const torch::Tensor& t, int64_t dim);
// `t`'s shape with `dim` of `size`.
std::vector<int64_t> with_size(const torch::Tensor& t, int64_t dim, int64_t size);

// One step of a ring over send/recv, posted: `out` to the next rank, `in`
// from the previous one; wait() waits for both. A piece that is empty (the
// tail of an uneven torch.chunk) is neither sent nor received: every rank
// knows every size. `out` and `in` must outlive the wait.
struct RingStep {
  c10::intrusive_ptr<c10d::Work> sent, received;
  void wait() {
    if (received) received->wait();
    if (sent) sent->wait();
  }
};

RingStep ring_post(Group& g, const torch::Tensor& out, const torch::Tensor& in, int tag);

// A gather's or a reduce-scatter's delay point, count and record (collectives.cpp).
Recorded counted_gather(Group& g, const torch::Tensor& t, int64_t dim, const std::vector<int64_t>& sizes,
                        bool timed = true);
Recorded counted_reduce_scatter(Group& g, const torch::Tensor& t, int64_t dim, int64_t global, bool timed = true);

}  // namespace composer::parallel::detail

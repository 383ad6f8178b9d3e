// A thin layer over c10d process groups: blocking and async collectives with
// uneven-size support (torch.chunk semantics, padded buffers), autograd-aware
// variants, and a counter of calls and bytes per group so tests can assert
// communication and benchmarks can report volume against theory. On a group
// without a process group (a dry run, runner/estimate/dry_run.h) a collective moves
// nothing but allocates what it would and counts its bytes, so a dry run's
// counters and memory match a real run's.
#pragma once
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "parallelisms/comm/mesh.h"

namespace composer::parallel {

// An in-flight collective; wait() finishes it (including any post-processing).
class Handle {
 public:
  Handle() = default;
  Handle(c10::intrusive_ptr<c10d::Work> work, std::function<void()> then);
  void wait();
  bool pending() const { return work_ || then_; }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> then_;
};

enum class Reduce { kSum, kAvg, kMax };

// In place. A size-1 group issues nothing.
Handle all_reduce(Group& g, torch::Tensor& t, Reduce op = Reduce::kSum, bool async = false);
void broadcast(Group& g, torch::Tensor& t, int root);  // root is a group rank

// The shards of every rank concatenated on dim 0. Shards may differ in size
// on dim 0 (torch.chunk: ceil-sized, the tail smaller or empty); `sizes`
// gives every rank's dim-0 size. Over Gloo a ring of send/recv moves each
// piece straight into the output; NCCL's all-gather pads every piece to the
// largest. The counters count the padded piece either way.
torch::Tensor all_gather(Group& g, const torch::Tensor& shard, const std::vector<int64_t>& sizes);

// Sums `full` over the group and returns this rank's torch.chunk piece of dim 0.
torch::Tensor reduce_scatter(Group& g, const torch::Tensor& full, Reduce op = Reduce::kSum);

// Flat-buffer forms for sharding engines, without extra full-size copies.
// Every rank's `flat` into the rows of `out` ([size, flat.numel()], same
// dtype): a ring over send/recv straight into `out`, with no staging buffer.
// With async the ring runs on a helper thread and the handle's wait() joins
// it; at most one may be in flight per group next to the blocking
// collectives (it uses its own tags).
Handle all_gather_into(Group& g, const torch::Tensor& flat, torch::Tensor out, bool async = false);
// The sum (or average) of a [size * chunk] buffer's chunk of this rank, in a
// tensor of its own: it never aliases `flat` (whose chunks hold partial sums
// afterwards), so the caller may keep views of it and reuse `flat`.
torch::Tensor reduce_scatter_flat(Group& g, torch::Tensor flat, Reduce op = Reduce::kSum);

// Rows of `input` to every rank and back: the first send_counts[0] rows to
// group rank 0, the next send_counts[1] to rank 1, ...; returns the rows
// received, recv_counts[s] from rank s, in rank order (c10d's alltoall_base,
// uneven splits; every rank's send_counts[r] is rank r's recv_counts of it).
torch::Tensor all_to_all(Group& g, const torch::Tensor& input, const std::vector<int64_t>& send_counts,
                         const std::vector<int64_t>& recv_counts);

// Point to point; an async send or receive completes at the handle's wait().
// A receive posted early lets the transport move the data while this rank
// computes: Gloo transfers a message once both sides have posted it.
Handle send(Group& g, const torch::Tensor& t, int dst, int tag = 0, bool async = false);
Handle recv(Group& g, torch::Tensor& t, int src, int tag = 0, bool async = false);

// Dim-0 sizes of torch.chunk(n, parts): ceil-sized chunks, the tail smaller or empty.
std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts);
// Where piece `rank` of `sizes` starts: the sum of the pieces before it.
int64_t offset_of(const std::vector<int64_t>& sizes, int rank);

// Along any dim (negative counts from the end), without autograd: every
// rank's torch.chunk piece of a `global`-sized dim concatenated, and this
// rank's piece of the sum of every rank's `t`, in a tensor of its own. Over
// Gloo a ring of send/recv moves each piece as it lies; NCCL pads the pieces.
torch::Tensor gather_dim(Group& g, const torch::Tensor& t, int64_t dim, int64_t global);
torch::Tensor reduce_scatter_dim(Group& g, const torch::Tensor& t, int64_t dim);
// Autograd-aware: forward all-reduce (sum), backward identity.
torch::Tensor all_reduce_autograd(Group& g, const torch::Tensor& t);
// Forward identity, backward all-reduce (sum) of the gradient.
torch::Tensor reduce_grad_autograd(Group& g, const torch::Tensor& t);
// Forward all-gather on dim 0 (uneven allowed), backward reduce-scatter (sum).
torch::Tensor all_gather_autograd(Group& g, const torch::Tensor& shard, const std::vector<int64_t>& sizes);
// Forward all_to_all; backward the all_to_all the other way (counts swapped).
torch::Tensor all_to_all_autograd(Group& g, const torch::Tensor& input, const std::vector<int64_t>& send_counts,
                                  const std::vector<int64_t>& recv_counts);
// Forward reduce-scatter (sum) on dim 0, backward all-gather.
torch::Tensor reduce_scatter_autograd(Group& g, const torch::Tensor& full);

// Along any dim (negative counts from the end), for activations:
// forward all-gather of the torch.chunk shards of a `global`-sized dim;
// backward reduce-scatter (the gathered tensor feeds sharded compute whose
// gradients are partial) or the local slice (its gradient is already replicated).
torch::Tensor gather_along(Group& g, const torch::Tensor& t, int64_t dim, int64_t global, bool backward_reduce);

// Partial gradients of a gathered activation, kept apart from its other
// gradients: sharded compute (a colwise Linear) that consumes a gathered
// tensor through tap_partial() leaves its partial input gradient here instead
// of all-reducing it; the gather's backward then reduce-scatters their sum
// once and adds the local slice of whatever else the tensor's users gave it.
// One per gather and forward pass.
struct PartialGrads {
  torch::Tensor sum;        // the taps' gradients, summed (undefined: none arrived)
  bool collecting = false;  // a gather's backward will take them (false: a 1-rank group or no autograd)
};
// gather_along with the backward above: reduce-scatter of `partials` plus the
// local slice of the ordinary gradient.
torch::Tensor gather_along_partials(Group& g, const torch::Tensor& t, int64_t dim, int64_t global,
                                    std::shared_ptr<PartialGrads> partials);
// Forward identity; backward adds the gradient into `partials` and gives
// none to `t` (the gather that made `t` reduce-scatters it).
torch::Tensor tap_partial(const torch::Tensor& t, std::shared_ptr<PartialGrads> partials);
// Forward: this rank's torch.chunk slice; backward: all-gather.
torch::Tensor scatter_along(Group& g, const torch::Tensor& t, int64_t dim);
// Forward: sum over the group, keep this rank's slice; backward: all-gather.
torch::Tensor reduce_scatter_along(Group& g, const torch::Tensor& t, int64_t dim);


// Collectives fused with the compute that consumes or produces their pieces
// ("async TP"): over Gloo each piece's transfer overlaps the compute on
// another, on the ring (tags, counters, spans and delay points) of
// gather_along and reduce_scatter_along. NCCL and a device tensor over Gloo
// take the rooted forms below. Not autograd-aware: tensor parallelism's
// fused Linears build their backward from them.
//
// Every rank's torch.chunk piece of a `global`-sized `dim` (`t` is this
// rank's) is handed to `each(rank, piece)`: this rank's first, then each as
// it arrives, while the next one moves. Returns the pieces in rank order.
std::vector<torch::Tensor> gather_along_each(Group& g, const torch::Tensor& t, int64_t dim, int64_t global,
                                             const std::function<void(int, const torch::Tensor&)>& each);
// This rank's torch.chunk piece of `dim` of a sum over the group that no rank
// holds whole: `partial(i)` computes this rank's addend of piece i, each
// while the running sum of another moves. The additions are in the order of
// reduce_scatter_along's; the result is a tensor of its own.
torch::Tensor reduce_scatter_computed(Group& g, int64_t dim, int64_t global,
                                      const std::function<torch::Tensor(int)>& partial);

// The two above as NCCL (and a device tensor over Gloo) runs them: one
// collective per piece, rooted at the rank that holds it (a broadcast) or
// gets it (a reduce), all issued at once in rank order, so no two ranks can
// wait on each other in a cycle. A piece's compute waits for its own piece
// only; on NCCL that wait orders this rank's stream after NCCL's without
// blocking the host, so one piece's product runs on the GPU while the next
// piece moves. gather_each_by_root hands this rank's piece first, then the
// others in rank order. reduce_scatter_by_root computes the partials in rank
// order; its sums are in the backend's order. Public so that their
// arithmetic is tested over Gloo on the CPU too.
std::vector<torch::Tensor> gather_each_by_root(Group& g, const torch::Tensor& t, int64_t dim, int64_t global,
                                               const std::function<void(int, const torch::Tensor&)>& each);
torch::Tensor reduce_scatter_by_root(Group& g, int64_t dim, int64_t global,
                                     const std::function<torch::Tensor(int)>& partial);

}  // namespace composer::parallel

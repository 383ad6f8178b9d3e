#include "parallelisms/comm/collectives.h"

#include <ATen/ThreadLocalState.h>

#include <future>
#include <numeric>
#include <optional>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "parallelisms/comm/collectives_detail.h"
#include "parallelisms/comm/delay.h"

namespace composer::parallel {

using namespace detail;  // the helpers collectives_fused.cpp shares

Handle::Handle(c10::intrusive_ptr<c10d::Work> work, std::function<void()> then)
    : work_(std::move(work)), then_(std::move(then)) {}

void Handle::wait() {
  CommClock clock;  // waiting for a collective is time in communication
  if (work_) work_->wait();
  work_.reset();
  if (then_) {
    auto f = std::move(then_);
    then_ = nullptr;
    f();
  }
}

namespace detail {

int64_t nbytes(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Gloo sums no bfloat16 (and composer sums float16 as it sums bfloat16):
// such tensors are summed in float32 and rounded once at the end.
bool sixteen_bit(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

c10d::ReduceOp to_c10d(Reduce op) {
  return op == Reduce::kMax ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
}

// NCCL runs every collective on the GPU itself, on its own stream: a wait
// orders the caller's stream after it without blocking the host, so an
// all-gather issued early overlaps the compute before its wait.
bool nccl(const Group& g) { return g.pg && g.pg->getBackendName() == "nccl"; }

// Where a collective on `g` moves `t`'s bytes from: NCCL moves device memory
// only, so a host tensor (an offloaded shard's gradient, a checkpoint's
// statistics) goes through a copy on this rank's GPU; Gloo moves host memory,
// so a device tensor (ranks sharing a GPU over Gloo) goes through a host copy.
c10::Device wire_device(const Group& g, const torch::Tensor& t) {
  if (!g.pg || t.is_meta()) return t.device();
  if (nccl(g)) return t.is_cuda() ? t.device() : c10::Device(c10::kCUDA);
  return c10::kCPU;
}
bool rewired(const Group& g, const torch::Tensor& t) { return wire_device(g, t) != t.device(); }

// What a Gloo collective run on its worker thread (all-reduce, broadcast,
// all-gather) is handed for a host tensor: a view of the same bytes that does
// not own them. The worker holds a finished work, and with it the work's
// tensors, for a moment after wait() returns; were those tensors owners, when
// a buffer is freed (and so a rank's counted peak) would be left to chance.
// Only for a collective waited on before the caller's owning tensor can go:
// the caller's tensor owns the bytes. Device tensors are handed as they are
// (the caching allocator's stream bookkeeping needs the owner).
torch::Tensor unowned(const torch::Tensor& t) {
  if (!t.device().is_cpu() || t.numel() == 0) return t;
  return torch::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
}

// Reduce-scatter over equal-size flat chunks: NCCL's own, or a ring over
// send/recv for backends without a correct native one (Gloo): N-1 steps, each
// rank sends one chunk per step, the (N-1)/N volume of the ring algorithm.
torch::Tensor ring_reduce_scatter(Group& g, torch::Tensor acc, int64_t chunk) {
  if (nccl(g)) {
    auto mine = torch::empty({chunk}, acc.options());
    g.pg->_reduce_scatter_base(mine, acc)->wait();
    return mine;
  }
  if (rewired(g, acc)) return ring_reduce_scatter(g, acc.to(wire_device(g, acc)), chunk).to(acc.device());
  const int n = g.size, r = g.rank;
  auto piece = [&](int i) { return acc.narrow(0, static_cast<int64_t>(i) * chunk, chunk); };
  auto incoming = torch::empty_like(piece(0));
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;
  torch::Tensor mine;
  for (int s = 0; s < n - 1 && g.pg; ++s) {
    int send_idx = ((r - s - 1) % n + n) % n, recv_idx = ((r - s - 2) % n + n) % n;
    std::vector<torch::Tensor> out{piece(send_idx).contiguous()}, in{incoming};
    auto sw = g.pg->send(out, next, s);
    auto rw = g.pg->recv(in, prev, s);
    rw->wait();
    sw->wait();
    // The last step's sum (recv_idx == r) goes into a tensor of its own, as NCCL's output does.
    if (s == n - 2) mine = piece(recv_idx) + incoming;
    else piece(recv_idx).add_(incoming);
  }
  return mine.defined() ? mine : piece(r).clone();  // a dry run allocates the same
}

}  // namespace detail

std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts) {
  const int64_t c = (n + parts - 1) / parts;
  std::vector<int64_t> s;
  for (int64_t i = 0; i < parts; ++i) s.push_back(std::max<int64_t>(0, std::min(c, n - i * c)));
  return s;
}

// "all_gather dp 1048576 B": a collective's span in the profiler's trace, with
// the payload its counter adds (tools/trace-overlap and the merged trace read it).
namespace detail {

Handle Recorded::handle(c10::intrusive_ptr<c10d::Work> work, std::function<void()> then) {
  finish_ = false;
  op_.waiting(false);
  return Handle(c10::intrusive_ptr<c10d::Work>(), [op = op_, work = std::move(work), then = std::move(then)] {
    op.waiting(true);
    if (work) work->wait();
    if (then) then();
    op.finished();
  });
}

std::function<std::string()> span_name(const Group& g, const char* kind, int64_t bytes) {
  return [&g, kind, bytes] { return std::string(kind) + " " + g.name + " " + std::to_string(bytes) + " B"; };
}

}  // namespace detail

namespace detail {

// Counts and records a collective and opens its span: they always name the
// same kind and payload.
class Counted {
 public:
  Counted(Group& g, const char* kind, int64_t bytes, int64_t ring_bytes, c10::ScalarType dtype, int peer = -1)
      : rec(g, kind, bytes, ring_bytes, dtype, peer), span_(span_name(g, kind, bytes)) {}
  Recorded rec;

 private:
  TraceSpan span_;
};

// debug.inject skip_collective: this rank leaves out the gradient reduction the recorder picks.
bool skipped(const Group& g) { return g.recorder && g.recorder->skips_reduction(); }

}  // namespace detail

int64_t offset_of(const std::vector<int64_t>& sizes, int rank) {
  int64_t o = 0;
  for (int i = 0; i < rank; ++i) o += sizes[i];
  return o;
}

Handle all_reduce(Group& g, torch::Tensor& t, Reduce op, bool async) {
  if (g.size == 1 || skipped(g)) return {};
  delay_at(g.delays, DelayPoint::kBeforeAllReduce);
  // bfloat16 and float16 tensors are summed in float32 and rounded once at
  // the end: a 16-bit ring would round after every hop, so its sum would
  // depend on the group size and the ranks' order. Twice the bytes, for a
  // result that is the same at any group size.
  const bool widen = sixteen_bit(t);
  auto wire = (widen ? t.to(torch::kFloat) : t).to(wire_device(g, t));
  Counted span(g, "all_reduce", nbytes(wire), 2 * (g.size - 1) * nbytes(wire) / g.size, wire.scalar_type());
  std::vector<torch::Tensor> ts{async ? wire : unowned(wire)};
  c10::intrusive_ptr<c10d::Work> work;
  if (g.pg) work = g.pg->allreduce(ts, c10d::AllreduceOptions{to_c10d(op)});
  span.rec.started();
  std::function<void()> then;
  const bool copy_back = !wire.is_same(t);  // widened, or moved to the backend's memory
  if (op == Reduce::kAvg || copy_back) {
    auto target = t;
    const double inv = op == Reduce::kAvg ? 1.0 / g.size : 1.0;
    then = [target, wire, inv, copy_back]() mutable {
      if (inv != 1.0) wire.mul_(inv);
      if (copy_back) target.copy_(wire);
    };
  }
  Handle h = span.rec.handle(work, std::move(then));
  if (!async) h.wait();
  return h;
}

void broadcast(Group& g, torch::Tensor& t, int root) {
  if (g.size == 1) return;
  Counted span(g, "broadcast", nbytes(t), g.rank == root ? nbytes(t) : 0, t.scalar_type());
  auto wire = t.to(wire_device(g, t));
  std::vector<torch::Tensor> ts{unowned(wire)};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  if (g.pg) g.pg->broadcast(ts, o)->wait();
  if (!wire.is_same(t)) t.copy_(wire);
}

namespace detail {

// The bytes of one index of `dim` (of an empty piece too).
int64_t slice_bytes(const torch::Tensor& t, int64_t dim) {
  int64_t b = t.element_size();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d != dim) b *= t.size(d);
  }
  return b;
}

std::vector<int64_t> with_size(const torch::Tensor& t, int64_t dim, int64_t size) {
  auto shape = t.sizes().vec();
  shape[dim] = size;
  return shape;
}

RingStep ring_post(Group& g, const torch::Tensor& out, const torch::Tensor& in, int tag) {
  RingStep step;
  if (!g.pg) return step;  // a dry run: the buffers are allocated, nothing moves
  const int n = g.size, next = (g.rank + 1) % n, prev = (g.rank - 1 + n) % n;
  if (out.numel()) {
    std::vector<torch::Tensor> v{unowned(out)};
    step.sent = g.pg->send(v, next, tag);
  }
  if (in.numel()) {
    std::vector<torch::Tensor> v{unowned(in)};
    step.received = g.pg->recv(v, prev, tag);
  }
  return step;
}

void ring_step(Group& g, const torch::Tensor& out, const torch::Tensor& in, int tag) { ring_post(g, out, in, tag).wait(); }

// A gather's delay point, count and record: every piece at the largest
// one's size (what the padded paths move); its bytes() are that size, for its
// spans. `timed`: all of it is time in communication (not a fused form).
Recorded counted_gather(Group& g, const torch::Tensor& t, int64_t dim, const std::vector<int64_t>& sizes,
                        bool timed) {
  delay_at(g.delays, DelayPoint::kBeforeAllGather);
  const int64_t piece = *std::max_element(sizes.begin(), sizes.end()) * slice_bytes(t, dim);
  return Recorded(g, "all_gather", piece, (g.size - 1) * piece, t.scalar_type(), -1, timed);
}

// A reduce-scatter's delay point, count and record, of a `global`-sized dim
// whose slices are `t`'s: the padded flat buffer of N equal pieces (bytes()).
Recorded counted_reduce_scatter(Group& g, const torch::Tensor& t, int64_t dim, int64_t global, bool timed) {
  delay_at(g.delays, DelayPoint::kBeforeReduceScatter);
  const int64_t flat = g.size * chunk_sizes(global, g.size).front() * slice_bytes(t, dim);
  return Recorded(g, "reduce_scatter", flat, (g.size - 1) * flat / g.size, t.scalar_type(), -1, timed);
}

// NCCL's path for the dim collectives: dim 0 first, every piece padded to the largest.
torch::Tensor padded_all_gather(Group& g, const torch::Tensor& shard, const std::vector<int64_t>& sizes) {
  const int64_t max = *std::max_element(sizes.begin(), sizes.end());
  auto padded = torch::zeros(with_size(shard, 0, max), shard.options().device(wire_device(g, shard)));
  if (shard.size(0) > 0) padded.narrow(0, 0, shard.size(0)).copy_(shard);
  auto out = torch::empty(with_size(padded, 0, g.size * max), padded.options());
  auto rows = out.view({g.size, -1});
  auto mine = rows[g.rank];
  mine.copy_(padded.view({-1}));
  g.pg->_allgather_base(rows, mine)->wait();
  std::vector<torch::Tensor> parts;
  for (int i = 0; i < g.size; ++i) parts.push_back(out.narrow(0, i * max, sizes[i]));
  return torch::cat(parts, 0).to(shard.device());
}

torch::Tensor padded_reduce_scatter(Group& g, const torch::Tensor& full) {
  auto sizes = chunk_sizes(full.size(0), g.size);
  const int64_t max = sizes.front();
  const int64_t row = full.numel() / std::max<int64_t>(1, full.size(0));
  auto flat = torch::zeros({g.size * max * row}, full.options());  // N equal chunks, each a padded piece
  auto src = full.contiguous().view({-1});
  for (int i = 0; i < g.size; ++i) {
    flat.narrow(0, i * max * row, sizes[i] * row).copy_(src.narrow(0, offset_of(sizes, i) * row, sizes[i] * row));
  }
  return ring_reduce_scatter(g, flat, max * row).narrow(0, 0, sizes[g.rank] * row).view(with_size(full, 0, sizes[g.rank]));
}

// Every rank's piece of `dim` (`sizes` along it; this rank's is `t`),
// concatenated. Over Gloo a ring of send/recv moves each piece straight into
// its place: into the output itself when a piece of `dim` is one contiguous
// block (dim 0), else into a tensor of its own, joined by one cat. Gloo's own
// allgather stages every piece through a flat buffer and was 4x slower than a
// send/recv pair for 32 MiB between two local ranks; gathering dim 0 after
// moving `dim` there costs two transposing copies more.
torch::Tensor gather_pieces(Group& g, const torch::Tensor& t, int64_t dim, const std::vector<int64_t>& sizes) {
  const int n = g.size, r = g.rank;
  if (nccl(g)) {
    return padded_all_gather(g, t.movedim(dim, 0).contiguous(), sizes).movedim(0, dim);
  }
  if (rewired(g, t)) return gather_pieces(g, t.to(wire_device(g, t)), dim, sizes).to(t.device());
  const int64_t global = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  int64_t outer = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= t.size(d);
  std::vector<torch::Tensor> pieces(n);
  torch::Tensor out;
  if (outer == 1) {  // the pieces are blocks of the output
    out = torch::empty(with_size(t, dim, global), t.options());
    for (int i = 0; i < n; ++i) pieces[i] = out.narrow(dim, offset_of(sizes, i), sizes[i]);
    pieces[r].copy_(t);
  } else {
    for (int i = 0; i < n; ++i) pieces[i] = i == r ? t.contiguous() : torch::empty(with_size(t, dim, sizes[i]), t.options());
  }
  for (int s = 0; s < n - 1; ++s) {
    ring_step(g, pieces[((r - s) % n + n) % n], pieces[((r - s - 1) % n + n) % n], kPiecesTag + s);
  }
  return out.defined() ? out : torch::cat(pieces, dim);
}

// This rank's torch.chunk piece of `dim` of the sum of every rank's `t`, in a
// tensor of its own (`t` is left as it is). Over Gloo a ring of send/recv:
// N-1 steps, each sending one piece's running sum, in the order of
// ring_reduce_scatter's additions; the pieces are views of `t`, so `dim` is
// never moved first.
torch::Tensor reduce_scatter_pieces(Group& g, const torch::Tensor& t, int64_t dim) {
  const int n = g.size, r = g.rank;
  if (nccl(g)) return padded_reduce_scatter(g, t.movedim(dim, 0).contiguous()).movedim(0, dim);
  if (rewired(g, t)) return reduce_scatter_pieces(g, t.to(wire_device(g, t)), dim).to(t.device());
  const auto sizes = chunk_sizes(t.size(dim), n);
  auto piece = [&](int i) { return t.narrow(dim, offset_of(sizes, i), sizes[i]); };
  std::vector<torch::Tensor> sums(n);  // the running sums this rank holds
  for (int s = 0; s < n - 1; ++s) {
    const int send_idx = ((r - s - 1) % n + n) % n, recv_idx = ((r - s - 2) % n + n) % n;
    auto out = s == 0 ? piece(send_idx).contiguous() : std::move(sums[send_idx]);
    auto incoming = torch::empty(with_size(t, dim, sizes[recv_idx]), t.options());
    ring_step(g, out, incoming, kPiecesTag + s);
    sums[recv_idx] = piece(recv_idx) + incoming;
  }
  return std::move(sums[r]);
}

}  // namespace detail

torch::Tensor all_gather(Group& g, const torch::Tensor& shard, const std::vector<int64_t>& sizes) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(sizes.size()) == g.size);
  if (g.size == 1) return shard;
  Recorded rec = counted_gather(g, shard, 0, sizes);
  TraceSpan span(span_name(g, "all_gather", rec.bytes()));
  return gather_pieces(g, shard, 0, sizes);
}

torch::Tensor reduce_scatter(Group& g, const torch::Tensor& full, Reduce op) {
  if (g.size == 1) return full.clone();
  TORCH_INTERNAL_ASSERT(op != Reduce::kMax, "reduce_scatter supports sum and avg");
  Recorded rec = counted_reduce_scatter(g, full, 0, full.size(0));
  TraceSpan span(span_name(g, "reduce_scatter", rec.bytes()));
  auto mine = reduce_scatter_pieces(g, full, 0);
  if (op == Reduce::kAvg) mine.div_(g.size);
  return mine;
}

namespace detail {

constexpr int kAllGatherTag = 1 << 20;  // ring reduce-scatter uses tags 0 .. size-2

// Every rank's row of `out` from its owner: NCCL's all-gather in place, or a
// ring over send/recv.
void ring_all_gather(Group& g, torch::Tensor out) {
  if (nccl(g)) {
    auto mine = out[g.rank];
    g.pg->_allgather_base(out, mine)->wait();
    return;
  }
  if (rewired(g, out)) {
    auto wire = out.to(wire_device(g, out));
    ring_all_gather(g, wire);
    out.copy_(wire);
    return;
  }
  const int n = g.size, r = g.rank;
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;
  for (int s = 0; s < n - 1 && g.pg; ++s) {
    const int send_idx = ((r - s) % n + n) % n, recv_idx = ((r - s - 1) % n + n) % n;
    std::vector<torch::Tensor> out_t{out[send_idx]}, in_t{out[recv_idx]};
    auto sw = g.pg->send(out_t, next, kAllGatherTag + s);
    auto rw = g.pg->recv(in_t, prev, kAllGatherTag + s);
    rw->wait();
    sw->wait();
  }
}

}  // namespace detail

Handle all_gather_into(Group& g, const torch::Tensor& flat, torch::Tensor out, bool async) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == g.size && out.size(1) == flat.numel() && out.is_contiguous(),
              "all_gather_into needs a contiguous [group size, numel] output");
  out[g.rank].copy_(flat.view({-1}));
  if (g.size == 1) return {};
  Recorded rec(g, "all_gather", nbytes(flat), (g.size - 1) * nbytes(flat), flat.scalar_type());
  if (!async || !g.pg) {
    TraceSpan span(span_name(g, "all_gather", nbytes(flat)));
    delay_at(g.delays, DelayPoint::kBeforeAllGather);
    ring_all_gather(g, out);
    return {};
  }
  if (nccl(g)) {  // asynchronous on the device already; the handle keeps `out` alive until its wait
    TraceSpan span(span_name(g, "all_gather", nbytes(flat)));
    delay_at(g.delays, DelayPoint::kBeforeAllGather);
    auto mine = out[g.rank];
    return rec.handle(g.pg->_allgather_base(out, mine), [out] {});
  }
  Group* gp = &g;
  // The caller's thread-local state (the profiler's, among others) goes with the ring.
  const int64_t bytes = nbytes(flat);
  auto done = std::make_shared<std::future<void>>(std::async(std::launch::async, [gp, out, bytes, tls = at::ThreadLocalState()] {
    at::ThreadLocalStateGuard state(tls);
    TraceSpan span(span_name(*gp, "all_gather", bytes));  // the ring's span, on its own thread
    delay_at(gp->delays, DelayPoint::kBeforeAllGather);  // on the helper thread: the caller runs on
    ring_all_gather(*gp, out);
  }));
  return rec.handle(c10::intrusive_ptr<c10d::Work>(), [done] { done->get(); });
}

torch::Tensor reduce_scatter_flat(Group& g, torch::Tensor flat, Reduce op) {
  const int64_t chunk = flat.numel() / g.size;
  if (g.size == 1) return flat.reshape({-1}).clone();
  if (skipped(g)) return flat.view({-1}).narrow(0, g.rank * chunk, chunk).clone();  // this rank's own addend only
  delay_at(g.delays, DelayPoint::kBeforeReduceScatter);
  Counted span(g, "reduce_scatter", nbytes(flat), (g.size - 1) * nbytes(flat) / g.size, flat.scalar_type());
  auto mine = ring_reduce_scatter(g, flat.view({-1}), chunk);
  if (op == Reduce::kAvg) mine.div_(g.size);
  return mine;
}

torch::Tensor all_to_all(Group& g, const torch::Tensor& input, const std::vector<int64_t>& send_counts,
                         const std::vector<int64_t>& recv_counts) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(send_counts.size()) == g.size && static_cast<int>(recv_counts.size()) == g.size);
  int64_t sent = 0, received = 0;
  for (int r = 0; r < g.size; ++r) {
    sent += send_counts[r];
    received += recv_counts[r];
  }
  TORCH_CHECK(sent == input.size(0), "all_to_all: send counts sum to ", sent, " but the input has ", input.size(0),
              " rows");
  auto shape = input.sizes().vec();
  shape[0] = received;
  if (g.size == 1) return input.clone();
  const int64_t row = input.numel() / std::max<int64_t>(1, input.size(0)) * static_cast<int64_t>(input.element_size());
  Counted span(g, "all_to_all", sent * row, (sent - send_counts[g.rank]) * row, input.scalar_type());
  if (!g.pg) return torch::empty(shape, input.options());  // a dry run: counted, nothing moves
  delay_at(g.delays, DelayPoint::kBeforeAllToAll);
  auto wire_in = input.to(wire_device(g, input)).contiguous();
  auto wire_out = torch::empty(shape, wire_in.options());
  std::vector<int64_t> out_splits(recv_counts), in_splits(send_counts);
  g.pg->alltoall_base(wire_out, wire_in, out_splits, in_splits)->wait();
  return wire_out.to(input.device());
}

Handle send(Group& g, const torch::Tensor& t, int dst, int tag, bool async) {
  delay_at(g.delays, DelayPoint::kBeforeSend);
  auto c = t.to(wire_device(g, t)).contiguous();
  Counted span(g, "send", nbytes(c), nbytes(c), c.scalar_type(), dst);
  std::vector<torch::Tensor> ts{c};
  auto work = g.pg ? g.pg->send(ts, dst, tag) : c10::intrusive_ptr<c10d::Work>();
  span.rec.started();
  Handle h = span.rec.handle(work, [c] {});  // the handle keeps the tensor alive until wait()
  if (!async) h.wait();
  return h;
}

Handle recv(Group& g, torch::Tensor& t, int src, int tag, bool async) {
  if (rewired(g, t)) {  // through a buffer on the wire's device, copied in at wait()
    auto wire = torch::empty(t.sizes(), t.options().device(wire_device(g, t)));
    Handle inner = recv(g, wire, src, tag, /*async=*/true);
    Handle h(c10::intrusive_ptr<c10d::Work>(), [inner, wire, t]() mutable {
      inner.wait();
      t.copy_(wire);
    });
    if (!async) h.wait();
    return h;
  }
  delay_at(g.delays, DelayPoint::kBeforeRecv);
  Counted span(g, "recv", nbytes(t), nbytes(t), t.scalar_type(), src);
  std::vector<torch::Tensor> ts{t};
  auto work = g.pg ? g.pg->recv(ts, src, tag) : c10::intrusive_ptr<c10d::Work>();
  span.rec.started();
  Handle h = span.rec.handle(work, [t] {});  // keeps the buffer alive until wait()
  if (!async) h.wait();
  return h;
}

torch::Tensor gather_dim(Group& g, const torch::Tensor& t, int64_t dim, int64_t global) {
  if (g.size == 1) return t;
  dim = dim < 0 ? dim + t.dim() : dim;
  const auto sizes = chunk_sizes(global, g.size);
  Recorded rec = counted_gather(g, t, dim, sizes);
  TraceSpan span(span_name(g, "all_gather", rec.bytes()));
  return gather_pieces(g, t, dim, sizes);
}

torch::Tensor reduce_scatter_dim(Group& g, const torch::Tensor& t, int64_t dim) {
  if (g.size == 1) return t.clone();
  dim = dim < 0 ? dim + t.dim() : dim;
  Recorded rec = counted_reduce_scatter(g, t, dim, t.size(dim));
  TraceSpan span(span_name(g, "reduce_scatter", rec.bytes()));
  return reduce_scatter_pieces(g, t, dim);
}

}  // namespace composer::parallel

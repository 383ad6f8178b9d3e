// The collectives fused with the compute that consumes or produces their
// pieces ("async TP"), and the rooted forms NCCL runs them as
// (collectives.h).
#include <ATen/ThreadLocalState.h>

#include "parallelisms/comm/collectives.h"
#include "parallelisms/comm/collectives_detail.h"
#include "parallelisms/comm/delay.h"

namespace composer::parallel {

using namespace detail;

std::vector<torch::Tensor> gather_along_each(Group& g, const torch::Tensor& t, int64_t dim, int64_t global,
                                             const std::function<void(int, const torch::Tensor&)>& each) {
  const int n = g.size, r = g.rank;
  dim = dim < 0 ? dim + t.dim() : dim;
  const auto sizes = chunk_sizes(global, n);
  std::vector<torch::Tensor> pieces(n);
  if (n == 1) {
    each(0, t);
    return {t};
  }
  if (nccl(g) || rewired(g, t)) return gather_each_by_root(g, t, dim, global, each);
  Recorded rec = counted_gather(g, t, dim, sizes, /*timed=*/false);
  const int64_t piece_bytes = rec.bytes();
  for (int i = 0; i < n; ++i) pieces[i] = i == r ? t.contiguous() : torch::empty(with_size(t, dim, sizes[i]), t.options());
  for (int s = 0; s < n - 1; ++s) {
    const int have = ((r - s) % n + n) % n, coming = ((r - s - 1) % n + n) % n;
    RingStep step;
    {
      CommClock clock;
      TraceSpan span(span_name(g, "all_gather", piece_bytes));
      step = ring_post(g, pieces[have], pieces[coming], kPiecesTag + s);
    }
    each(have, pieces[have]);  // while pieces[coming] moves
    CommClock clock;
    TraceSpan span(span_name(g, "all_gather", piece_bytes));
    step.wait();
  }
  each((r + 1) % n, pieces[(r + 1) % n]);
  return pieces;
}

torch::Tensor reduce_scatter_computed(Group& g, int64_t dim, int64_t global,
                                      const std::function<torch::Tensor(int)>& partial) {
  const int n = g.size, r = g.rank;
  const auto sizes = chunk_sizes(global, n);
  if (n == 1) return partial(0);
  auto first = partial(((r - 1) % n + n) % n);  // the piece this rank sends first
  dim = dim < 0 ? dim + first.dim() : dim;
  if (nccl(g) || rewired(g, first)) {
    return reduce_scatter_by_root(g, dim, global, [&](int i) { return i == (r - 1 + n) % n ? first : partial(i); });
  }
  Recorded rec = counted_reduce_scatter(g, first, dim, global, /*timed=*/false);
  const int64_t flat_bytes = rec.bytes();
  std::vector<torch::Tensor> sums(n);  // the running sums this rank holds
  for (int s = 0; s < n - 1; ++s) {
    const int send_idx = ((r - s - 1) % n + n) % n, recv_idx = ((r - s - 2) % n + n) % n;
    auto out = (s == 0 ? std::move(first) : std::move(sums[send_idx])).contiguous();
    auto incoming = torch::empty(with_size(out, dim, sizes[recv_idx]), out.options());
    RingStep step;
    {
      CommClock clock;
      TraceSpan span(span_name(g, "reduce_scatter", flat_bytes));
      step = ring_post(g, out, incoming, kPiecesTag + s);
    }
    auto mine = partial(recv_idx);  // while `out` and `incoming` move
    {
      CommClock clock;
      TraceSpan span(span_name(g, "reduce_scatter", flat_bytes));
      step.wait();
    }
    sums[recv_idx] = mine + incoming;
  }
  return std::move(sums[r]);
}

std::vector<torch::Tensor> gather_each_by_root(Group& g, const torch::Tensor& t, int64_t dim, int64_t global,
                                              const std::function<void(int, const torch::Tensor&)>& each) {
  const int n = g.size, r = g.rank;
  dim = dim < 0 ? dim + t.dim() : dim;
  const auto sizes = chunk_sizes(global, n);
  Recorded rec = counted_gather(g, t, dim, sizes, /*timed=*/false);
  const int64_t piece_bytes = rec.bytes();
  const auto wire = t.options().device(wire_device(g, t));
  std::vector<torch::Tensor> moving(n), pieces(n);
  std::vector<c10::intrusive_ptr<c10d::Work>> works(n);
  pieces[r] = t.contiguous();
  {
    CommClock clock;
    TraceSpan span(span_name(g, "all_gather", piece_bytes));
    for (int i = 0; i < n; ++i) {
      moving[i] = i == r ? pieces[r].to(wire.device()) : torch::empty(with_size(t, dim, sizes[i]), wire);
      if (!g.pg || sizes[i] == 0) continue;  // every rank knows every size
      std::vector<torch::Tensor> v{moving[i]};
      c10d::BroadcastOptions o;
      o.rootRank = i;
      works[i] = g.pg->broadcast(v, o);
    }
  }
  each(r, pieces[r]);  // while the others move
  for (int i = 0; i < n; ++i) {
    if (i == r) continue;
    if (works[i]) {
      CommClock clock;
      TraceSpan span(span_name(g, "all_gather", piece_bytes));
      works[i]->wait();
    }
    pieces[i] = moving[i].to(t.device());
    each(i, pieces[i]);
  }
  return pieces;
}

torch::Tensor reduce_scatter_by_root(Group& g, int64_t dim, int64_t global,
                                     const std::function<torch::Tensor(int)>& partial) {
  const int n = g.size, r = g.rank;
  const auto sizes = chunk_sizes(global, n);
  if (n == 1) return partial(0);
  std::vector<torch::Tensor> moving(n);
  std::vector<c10::intrusive_ptr<c10d::Work>> works(n);
  torch::TensorOptions result;  // the partials' dtype and device
  int64_t flat_bytes = 0;
  std::optional<Recorded> rec;
  for (int i = 0; i < n; ++i) {
    auto p = partial(i);  // while the sums before it move
    if (i == 0) {
      result = p.options();
      dim = dim < 0 ? dim + p.dim() : dim;
      delay_at(g.delays, DelayPoint::kBeforeReduceScatter);
      flat_bytes = g.size * chunk_sizes(global, g.size).front() * slice_bytes(p, dim);
      rec.emplace(g, "reduce_scatter", flat_bytes, (g.size - 1) * flat_bytes / g.size, p.scalar_type(), -1,
                  /*timed=*/false);
    }
    const bool widen = !nccl(g) && sixteen_bit(p);
    moving[i] = (widen ? p.to(torch::kFloat) : p).to(wire_device(g, p)).contiguous();
    if (!g.pg || sizes[i] == 0) continue;
    CommClock clock;
    TraceSpan span(span_name(g, "reduce_scatter", flat_bytes));
    std::vector<torch::Tensor> v{moving[i]};
    c10d::ReduceOptions o;
    o.rootRank = i;
    works[i] = g.pg->reduce(v, o);
  }
  {
    CommClock clock;
    TraceSpan span(span_name(g, "reduce_scatter", flat_bytes));
    for (auto& w : works) {
      if (w) w->wait();  // the other ranks' too: their buffers live until then
    }
  }
  return moving[r].to(result);
}

}  // namespace composer::parallel

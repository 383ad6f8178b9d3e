#include "parallelisms/context_parallel.h"

#include "models/layers.h"
#include "parallelisms/comm/p2p.h"
#include "parallelisms/parallel.h"

#include <cmath>
#include <limits>
#include <set>
#include <tuple>

namespace composer::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Point-to-point tags of the ring, apart from composer's own collectives'
// (0 .. size-2, 1 << 20 and 2 << 20) and each other: forward blocks,
// backward blocks, backward block gradients.
constexpr int kForwardTag = 3 << 20;
constexpr int kBackwardTag = kForwardTag + 1;
constexpr int kGradTag = kForwardTag + 2;

// The most tokens of a query or key tile off the CPU: attention is computed
// tile pair by tile pair and merged by log-sum-exp, so the scores held at once
// are at most kTile x kTile per head, whatever the sequence (as a
// flash-attention kernel bounds them), and tiles wholly in a query's future are
// skipped. On the CPU the pairs are whole chunks given to the flash kernel.
constexpr int64_t kTile = 256;

// A run of consecutive tokens in a rank's local tensor: where it starts
// there, its first global position and its length.
struct Tile {
  int64_t offset, position, len;
};

// The tiles of rank `rank`'s local sequence of `local_len` tokens: each of its
// chunks (contiguous global positions) cut into runs of at most `most` tokens.
// Chunks are of one length and cut alike, so a query tile and a key tile cover
// the same positions or disjoint ones.
std::vector<Tile> tiles_of(const ContextParallel& cp, int rank, int64_t local_len, int64_t most) {
  const auto chunks = sequence_chunks(cp.group().size, rank, cp.options().load_balance);
  const int64_t len = local_len / static_cast<int64_t>(chunks.size());
  TORCH_CHECK(len * static_cast<int64_t>(chunks.size()) == local_len, "context_parallel: a local sequence of ",
              local_len, " tokens does not split into ", chunks.size(), " chunks");
  std::vector<Tile> out;
  for (size_t i = 0; i < chunks.size(); ++i) {
    for (int64_t at = 0; at < len; at += most) {
      out.push_back({static_cast<int64_t>(i) * len + at, chunks[i] * len + at, std::min(most, len - at)});
    }
  }
  return out;
}

// (b, kv_heads, s, d) -> (b, heads, s, d): kv head j serves query heads
// j n_rep .. (j+1) n_rep - 1, as repeat_interleave(n_rep, 1) would.
torch::Tensor expand_heads(const torch::Tensor& t, int64_t n_rep) {
  if (n_rep == 1) return t;
  const auto s = t.sizes();
  return t.unsqueeze(2).expand({s[0], s[1], n_rep, s[2], s[3]}).reshape({s[0], s[1] * n_rep, s[2], s[3]});
}

// The gradient of expand_heads: each kv head's query heads summed.
torch::Tensor fold_heads(const torch::Tensor& g, int64_t n_rep) {
  if (n_rep == 1) return g;
  const auto s = g.sizes();
  return g.view({s[0], s[1] / n_rep, n_rep, s[2], s[3]}).sum(2);
}

// How a query tile meets a key tile under the causal mask: every key in the
// past (or the mask off), some, or none.
enum class Pair { kFull, kPartial, kSkip };
Pair pair_of(const Tile& q, const Tile& k, bool causal) {
  if (!causal || k.position + k.len - 1 <= q.position) return Pair::kFull;
  return k.position > q.position + q.len - 1 ? Pair::kSkip : Pair::kPartial;
}

// The tile pairs of one block to compute, query tile by query tile: every
// pair the causal mask does not skip. On meta tensors (a dry run) only shapes
// and bytes matter, and a pair of the lengths and kind of one already listed
// allocates the same transients, from the same live bytes (outputs are
// written in place), so it is left out: the peak and every byte count stay
// as they were, at a fraction of a long sequence's meta ops.
struct TilePair {
  Tile q, k;
  Pair pair;
};
std::vector<std::vector<TilePair>> tile_pairs(const std::vector<Tile>& q_tiles, const std::vector<Tile>& kv_tiles,
                                              bool causal, bool meta) {
  std::set<std::tuple<int64_t, int64_t, int>> seen;
  std::vector<std::vector<TilePair>> out;
  for (const Tile& qt : q_tiles) {
    std::vector<TilePair> row;
    for (const Tile& kt : kv_tiles) {
      const Pair pair = pair_of(qt, kt, causal);
      if (pair == Pair::kSkip || (meta && !seen.insert({qt.len, kt.len, static_cast<int>(pair)}).second)) continue;
      row.push_back({qt, kt, pair});
    }
    if (!row.empty()) out.push_back(std::move(row));
  }
  return out;
}

// Under packed documents, which keys of tile `kt` each query of tile `qt`
// may see ((b, 1, q len, k len) booleans, the causal mask of a partial pair
// included); a pair that meets no key in any sequence is skipped. Without
// documents: undefined, and `pair` alone decides.
torch::Tensor allowed_of(const torch::Tensor& doc_start, const Tile& qt, const Tile& kt, Pair& pair) {
  if (!doc_start.defined() || pair == Pair::kSkip) return {};
  const auto o = doc_start.options();
  auto allowed = nn::document_mask(doc_start, torch::arange(qt.position, qt.position + qt.len, o),
                                   torch::arange(kt.position, kt.position + kt.len, o), pair == Pair::kPartial);
  if (!allowed.is_meta() && !allowed.any().item<bool>()) pair = Pair::kSkip;  // a dry run keeps every pair
  return allowed;
}

// q k^T / sqrt(head_dim) of one tile pair, keys after their query masked (or,
// given `allowed`, every key it forbids).
torch::Tensor scores(const torch::Tensor& q, const torch::Tensor& k, const Tile& qt, const Tile& kt, Pair pair,
                     const torch::Tensor& allowed) {
  auto s = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (allowed.defined()) {
    s = s.masked_fill(allowed.bitwise_not(), -std::numeric_limits<double>::infinity());
  } else if (pair == Pair::kPartial) {  // key j after query i: j - i > q.position - k.position
    auto mask = torch::ones({qt.len, kt.len}, q.options().dtype(torch::kBool)).triu(qt.position - kt.position + 1);
    s = s.masked_fill(mask, -std::numeric_limits<double>::infinity());
  }
  return s;
}

// The float32 key and value of a block (2, b, kv_heads, s, d), heads expanded.
std::pair<torch::Tensor, torch::Tensor> key_value(const torch::Tensor& block, int64_t n_rep) {
  auto f = block.to(torch::kFloat);
  return {expand_heads(f[0], n_rep), expand_heads(f[1], n_rep)};
}

// Adds a partial result (`part` with its log-sum-exp `part_lse`) of some query
// rows to theirs so far: both rescaled to the larger log-sum-exp. Under
// packed documents a row may have met no key yet, nor in this part
// (log-sum-exp -inf on both sides): it stays empty. (masked_fill rather than
// where: the dry run's meta tensors have kernels for it; it changes no finite value.)
void merge(torch::Tensor out_i, torch::Tensor lse_i, const torch::Tensor& part, const torch::Tensor& part_lse) {
  auto top = torch::maximum(lse_i, part_lse);
  top = top.masked_fill(top == -std::numeric_limits<double>::infinity(), 0);
  auto kept = torch::exp(lse_i - top), added = torch::exp(part_lse - top), sum = kept + added;
  out_i.copy_(out_i * kept.unsqueeze(-1) + part * added.unsqueeze(-1));
  out_i.div_(sum.masked_fill(sum == 0, 1).unsqueeze(-1));
  lse_i.copy_(top + torch::log(sum));
}

// On the CPU each pair of chunks goes through LibTorch's flash attention kernel
// (the one scaled_dot_product_attention runs), which returns the pair's
// log-sum-exp for the merge and, in backward, takes the merged output and
// log-sum-exp. Elsewhere (a GPU, the dry run's meta tensors) the pairs are
// tiles computed below from matmul and exp.
bool cpu_kernel(const torch::Tensor& q) { return q.device().is_cpu(); }
constexpr int64_t kWholeChunk = std::numeric_limits<int64_t>::max();

// This rank's queries (float32) against the block of rank `src`, merged into
// `out` and its log-sum-exp `lse` by the partial results' log-sum-exp.
void attend(const ContextParallel& cp, const torch::Tensor& q, const torch::Tensor& block, int src, bool causal,
            const torch::Tensor& docs, torch::Tensor& out, torch::Tensor& lse) {
  auto [k, v] = key_value(block, q.size(1) / block.size(2));
  const bool flash = cpu_kernel(q) && !docs.defined();
  const int64_t most = flash ? kWholeChunk : kTile;
  const auto q_tiles = tiles_of(cp, cp.group().rank, q.size(2), most), kv_tiles = tiles_of(cp, src, k.size(2), most);
  if (flash) {
    for (const Tile& qt : q_tiles) {
      for (const Tile& kt : kv_tiles) {
        const Pair pair = pair_of(qt, kt, causal);
        if (pair == Pair::kSkip) continue;
        TORCH_INTERNAL_ASSERT(pair == Pair::kFull || (qt.position == kt.position && qt.len == kt.len));
        auto [part, part_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
            q.narrow(2, qt.offset, qt.len), k.narrow(2, kt.offset, kt.len), v.narrow(2, kt.offset, kt.len), 0.0,
            /*is_causal=*/pair == Pair::kPartial);
        merge(out.narrow(2, qt.offset, qt.len), lse.narrow(2, qt.offset, qt.len), part, part_lse);
      }
    }
    return;
  }
  for (const auto& row : tile_pairs(q_tiles, kv_tiles, causal, q.is_meta())) {
    const Tile& qt = row.front().q;
    auto qi = q.narrow(2, qt.offset, qt.len), out_i = out.narrow(2, qt.offset, qt.len);
    auto lse_i = lse.narrow(2, qt.offset, qt.len);
    for (TilePair tile : row) {
      const Tile& kt = tile.k;
      Pair& pair = tile.pair;  // packed documents may skip it yet
      const auto allowed = allowed_of(docs, qt, kt, pair);
      if (pair == Pair::kSkip) continue;
      // The pair's softmax by its row maximum (every row of a partial pair
      // keeps at least one key; under documents a row may keep none: its
      // maximum is taken as 0, its sum is 0 and its part empty), then both
      // parts rescaled to the larger log-sum-exp.
      auto s = scores(qi, k.narrow(2, kt.offset, kt.len), qt, kt, pair, allowed);
      auto row_max = std::get<0>(s.max(-1, /*keepdim=*/true));
      row_max = row_max.masked_fill(row_max == -std::numeric_limits<double>::infinity(), 0);
      auto e = torch::exp(s - row_max);
      auto sum = e.sum(-1, /*keepdim=*/true);
      auto part = torch::matmul(e / sum.masked_fill(sum == 0, 1), v.narrow(2, kt.offset, kt.len));
      merge(out_i, lse_i, part, (row_max + torch::log(sum)).squeeze(-1));
    }
  }
}

// The gradients of attend for one block: into dq (this rank's queries) and
// `grad` (2, b, kv_heads, s, d), the block's key and value gradients.
// `delta` is rowsum(dout * out).
void attend_backward(const ContextParallel& cp, const torch::Tensor& q, const torch::Tensor& block, int src,
                     bool causal, const torch::Tensor& docs, const torch::Tensor& dout, const torch::Tensor& out,
                     const torch::Tensor& lse, const torch::Tensor& delta, torch::Tensor& dq, torch::Tensor& grad) {
  const int64_t n_rep = q.size(1) / block.size(2);
  auto [k, v] = key_value(block, n_rep);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const bool flash = cpu_kernel(q) && !docs.defined();
  const int64_t most = flash ? kWholeChunk : kTile;
  const auto q_tiles = tiles_of(cp, cp.group().rank, q.size(2), most), kv_tiles = tiles_of(cp, src, k.size(2), most);
  if (flash) {
    for (const Tile& qt : q_tiles) {
      auto dq_i = dq.narrow(2, qt.offset, qt.len);
      for (const Tile& kt : kv_tiles) {
        const Pair pair = pair_of(qt, kt, causal);
        if (pair == Pair::kSkip) continue;
        TORCH_INTERNAL_ASSERT(pair == Pair::kFull || (qt.position == kt.position && qt.len == kt.len));
        auto [dq_part, dk_part, dv_part] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
            dout.narrow(2, qt.offset, qt.len), q.narrow(2, qt.offset, qt.len), k.narrow(2, kt.offset, kt.len),
            v.narrow(2, kt.offset, kt.len), out.narrow(2, qt.offset, qt.len),
            lse.narrow(2, qt.offset, qt.len).contiguous(), 0.0, /*is_causal=*/pair == Pair::kPartial);
        dq_i.add_(dq_part);
        grad[0].narrow(2, kt.offset, kt.len).add_(fold_heads(dk_part, n_rep));
        grad[1].narrow(2, kt.offset, kt.len).add_(fold_heads(dv_part, n_rep));
      }
    }
    return;
  }
  for (const auto& row : tile_pairs(q_tiles, kv_tiles, causal, q.is_meta())) {
    const Tile& qt = row.front().q;
    auto qi = q.narrow(2, qt.offset, qt.len), dout_i = dout.narrow(2, qt.offset, qt.len);
    auto dq_i = dq.narrow(2, qt.offset, qt.len);
    auto lse_i = lse.narrow(2, qt.offset, qt.len).unsqueeze(-1);
    auto delta_i = delta.narrow(2, qt.offset, qt.len).unsqueeze(-1);
    for (TilePair tile : row) {
      const Tile& kt = tile.k;
      Pair& pair = tile.pair;  // packed documents may skip it yet
      const auto allowed = allowed_of(docs, qt, kt, pair);
      if (pair == Pair::kSkip) continue;
      auto kj = k.narrow(2, kt.offset, kt.len), vj = v.narrow(2, kt.offset, kt.len);
      auto p = torch::exp(scores(qi, kj, qt, kt, pair, allowed) - lse_i);
      auto ds = p * (torch::matmul(dout_i, vj.transpose(-2, -1)) - delta_i);
      dq_i.add_(torch::matmul(ds, kj), scale);
      grad[0].narrow(2, kt.offset, kt.len).add_(fold_heads(torch::matmul(ds.transpose(-2, -1), qi), n_rep), scale);
      grad[1].narrow(2, kt.offset, kt.len).add_(fold_heads(torch::matmul(p.transpose(-2, -1), dout_i), n_rep));
    }
  }
}

// One step of the ring: `out` to the next rank and `in` from the previous
// one, as one group (on NCCL every rank's send would otherwise wait for a
// receive queued behind its peer's own send).
Handle ring_step(Group& g, const torch::Tensor& out, torch::Tensor& in, int tag) {
  const int n = g.size;
  return issue_group(g, {{true, out, (g.rank + 1) % n, tag, "ring send"}, {false, in, (g.rank + n - 1) % n, tag, "ring receive"}});
}

// Every block of keys and values passes this rank once: on_block(src, block)
// for the block of each rank src, this rank's own first. A ring sends the
// block on while this rank computes with it.
template <class F>
void each_block(const ContextParallel& cp, torch::Tensor block, F&& on_block) {
  Group& g = cp.group();
  const int n = g.size;
  if (cp.options().rotate == Rotate::kAllGather) {
    auto all = all_gather(g, block, std::vector<int64_t>(n, block.size(0)));
    for (int t = 0; t < n; ++t) {
      const int src = (g.rank + n - t) % n;
      on_block(src, all.narrow(0, src * block.size(0), block.size(0)));
    }
    return;
  }
  for (int t = 0; t < n; ++t) {
    const int src = (g.rank + n - t) % n;
    Handle moved;
    torch::Tensor incoming;
    if (t + 1 < n) {  // issued before the compute, so the block moves while this rank computes
      incoming = torch::empty_like(block);
      moved = ring_step(g, block, incoming, kForwardTag);
    }
    on_block(src, block);
    if (t + 1 < n) {
      moved.wait();
      block = incoming;
    }
  }
}

// The gradients of every block this rank's queries met, each delivered to its
// owner: on_block(src, block, grad) adds this rank's share to `grad` (float32,
// the block's shape). Returns this rank's own block's gradient, all ranks'
// shares summed. The ring passes each block on with its gradient so far; after
// a full turn the gradient is home. allgather reduce-scatters them instead.
template <class F>
torch::Tensor each_block_backward(const ContextParallel& cp, torch::Tensor block, F&& on_block) {
  Group& g = cp.group();
  const int n = g.size;
  auto float_zeros = [](const torch::Tensor& t) { return torch::zeros(t.sizes(), t.options().dtype(torch::kFloat)); };
  if (cp.options().rotate == Rotate::kAllGather) {
    const int64_t m = block.size(0);
    auto all = all_gather(g, block, std::vector<int64_t>(n, m));
    auto grads = float_zeros(all);
    for (int src = 0; src < n; ++src) {
      auto grad = grads.narrow(0, src * m, m);
      on_block(src, all.narrow(0, src * m, m), grad);
    }
    return reduce_scatter(g, grads);
  }
  auto grad = float_zeros(block);
  for (int t = 0; t < n; ++t) {
    const int src = (g.rank + n - t) % n;
    Handle moved;
    torch::Tensor incoming;
    if (t + 1 < n) {  // the next block moves while this rank computes with this one
      incoming = torch::empty_like(block);
      moved = ring_step(g, block, incoming, kBackwardTag);
    }
    on_block(src, block, grad);
    if (n > 1) {  // the gradient so far can only move once this rank has added its share
      auto grad_in = torch::empty_like(grad);
      ring_step(g, grad, grad_in, kGradTag).wait();
      grad = grad_in;
    }
    if (t + 1 < n) {
      moved.wait();
      block = incoming;
    }
  }
  return grad;
}

// All-to-all context parallelism (DeepSpeed's Ulysses): the sequence shard is
// traded for a head shard before attention and back after it. Each rank sends
// rank j its j-th slice of the heads for its own tokens, receives every rank's
// tokens of its own heads, and puts them in sequence order (`order`: the
// index, among the ranks' tokens concatenated in rank order, of each global
// position); attention then runs on whole sequences of 1/cp of the heads, with
// the kernel one device runs. Autograd moves the gradients back the other way.
torch::Tensor sequence_to_heads(Group& g, const torch::Tensor& t, const torch::Tensor& order) {
  const int64_t n = g.size, b = t.size(0), h = t.size(1), len = t.size(2), d = t.size(3);
  auto rows = t.reshape({b, n, h / n, len, d}).transpose(0, 1).contiguous().view({n, -1});
  auto got = all_to_all_autograd(g, rows, std::vector<int64_t>(n, 1), std::vector<int64_t>(n, 1));
  auto tokens = got.view({n, b, h / n, len, d}).permute({1, 2, 0, 3, 4}).reshape({b, h / n, n * len, d});
  return tokens.index_select(2, order);
}

// The inverse: every rank's tokens of this rank's heads go home, and this
// rank gets its tokens of every head. `concat`: the global position of each
// token of the ranks' concatenation (the inverse of `order`).
torch::Tensor heads_to_sequence(Group& g, const torch::Tensor& t, const torch::Tensor& concat) {
  const int64_t n = g.size, b = t.size(0), h = t.size(1), len = t.size(2) / n, d = t.size(3);
  auto by_rank = t.index_select(2, concat).view({b, h, n, len, d}).permute({2, 0, 1, 3, 4}).contiguous().view({n, -1});
  auto got = all_to_all_autograd(g, by_rank, std::vector<int64_t>(n, 1), std::vector<int64_t>(n, 1));
  return got.view({n, b, h, len, d}).transpose(0, 1).reshape({b, n * h, len, d});
}

torch::Tensor all_to_all_attention(const ContextParallel& cp, const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, bool causal, const torch::Tensor& docs) {
  Group& g = cp.group();
  const int n = g.size;
  TORCH_CHECK(q.size(1) % n == 0 && k.size(1) % n == 0, "context_parallel alltoall: ", q.size(1), " query and ",
              k.size(1), " key/value heads on this rank do not split over ", n, " ranks");
  const int64_t len = q.size(2);
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(cp.positions_of(r, len, torch::kCPU));
  auto concat = torch::cat(parts).to(q.device());  // global position of each concatenated token
  auto order = torch::argsort(concat);
  auto qh = sequence_to_heads(g, q, order), kh = sequence_to_heads(g, k, order), vh = sequence_to_heads(g, v, order);
  const int64_t n_rep = qh.size(1) / kh.size(1);  // grouped-query attention, within this rank's heads
  if (n_rep > 1) {
    kh = kh.repeat_interleave(n_rep, 1);
    vh = vh.repeat_interleave(n_rep, 1);
  }
  // Packed documents: the one-device mask of the whole sequence.
  const auto mask = docs.defined() ? nn::whole_document_mask(docs, causal) : torch::Tensor();
  return heads_to_sequence(g, nn::attention(qh, kh, vh, causal, 0, false, mask), concat);
}

// Group and split pointers travel through the autograd context as integers.
int64_t as_id(const ContextParallel& cp) { return reinterpret_cast<int64_t>(&cp); }
const ContextParallel& from_id(AutogradContext* ctx) {
  return *reinterpret_cast<const ContextParallel*>(ctx->saved_data["cp"].toInt());
}

struct SplitAttentionFn : torch::autograd::Function<SplitAttentionFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t docs_id, int64_t cp_id, bool causal) {
    const auto& cp = *reinterpret_cast<const ContextParallel*>(cp_id);
    // By address, as the group: an undefined tensor is no autograd input.
    const torch::Tensor docs = *reinterpret_cast<const torch::Tensor*>(docs_id);
    auto qf = q.to(torch::kFloat);
    auto out = torch::zeros(q.sizes(), qf.options());
    auto lse = torch::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(), qf.options());
    each_block(cp, torch::stack({k, v}), [&](int src, const torch::Tensor& block) {
      attend(cp, qf, block, src, causal, docs, out, lse);
    });
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["docs"] = docs;
    ctx->saved_data["cp"] = cp_id;
    ctx->saved_data["causal"] = causal;
    return out.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& cp = from_id(ctx);
    const bool causal = ctx->saved_data["causal"].toBool();
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    auto qf = q.to(torch::kFloat), dout = grads[0].to(torch::kFloat);
    const auto docs = ctx->saved_data["docs"].toTensor();
    // The flash kernel takes out itself.
    auto delta = cpu_kernel(qf) && !docs.defined() ? torch::Tensor() : (dout * out).sum(-1);
    auto dq = torch::zeros(qf.sizes(), qf.options());
    auto dkv = each_block_backward(cp, torch::stack({k, v}), [&](int src, const torch::Tensor& block, torch::Tensor& grad) {
      attend_backward(cp, qf, block, src, causal, docs, dout, out, lse, delta, dq, grad);
    });
    return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

const char* name_of(Rotate r) { return lookup(kRotateNames, r); }

std::vector<int64_t> sequence_chunks(int size, int rank, bool load_balance) {
  if (!load_balance) return {rank};
  return {rank, 2 * size - 1 - rank};
}

int64_t chunks_per_sequence(int size, bool load_balance) { return load_balance ? 2 * size : size; }

ContextParallel::ContextParallel(Group& group, const ContextParallelConfig& options)
    : group_(group), options_(options) {}

torch::Tensor ContextParallel::positions(int64_t local_len, const c10::Device& device) const {
  return positions_of(group_.rank, local_len, device);
}

torch::Tensor ContextParallel::positions_of(int rank, int64_t local_len, const c10::Device& device) const {
  const auto chunks = sequence_chunks(group_.size, rank, options_.load_balance);
  const int64_t len = local_len / static_cast<int64_t>(chunks.size());
  TORCH_CHECK(len * static_cast<int64_t>(chunks.size()) == local_len, "context_parallel: a local sequence of ",
              local_len, " tokens does not split into ", chunks.size(), " chunks");
  std::vector<torch::Tensor> parts;
  for (int64_t c : chunks) parts.push_back(torch::arange(c * len, (c + 1) * len, torch::dtype(torch::kLong).device(device)));
  return parts.size() == 1 ? parts[0] : torch::cat(parts);
}

torch::Tensor ContextParallel::attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         bool causal, const torch::Tensor& doc_start) const {
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "context_parallel attention: ", k.size(1), " key/value heads do not divide ",
              q.size(1), " query heads");
  const auto docs = doc_start.defined() ? doc_start.to(q.device()) : doc_start;
  if (options_.rotate == Rotate::kAllToAll) return all_to_all_attention(*this, q, k, v, causal, docs);
  const int64_t dv = v.size(-1), dk = k.size(-1);
  if (dv != dk) {
    // Values narrower than the keys (DeepSeek-V3's): the blocks travel as one tensor, so the values are
    // padded with zero dims, which attention maps to zero outputs, cut off after.
    TORCH_CHECK(dv < dk, "context_parallel attention: values of ", dv, " dims are wider than keys of ", dk);
    auto padded = torch::constant_pad_nd(v, {0, dk - dv});
    return SplitAttentionFn::apply(q, k, padded, reinterpret_cast<int64_t>(&docs), as_id(*this), causal)
        .narrow(-1, 0, dv);
  }
  return SplitAttentionFn::apply(q, k, v, reinterpret_cast<int64_t>(&docs), as_id(*this), causal);
}

torch::Tensor ContextParallel::slice(const torch::Tensor& t, int64_t dim) const {
  const int64_t seq = t.size(dim), pieces = chunks_per_sequence(group_.size, options_.load_balance);
  TORCH_CHECK(seq % pieces == 0, "context_parallel: a sequence of ", seq, " tokens does not split into ", pieces,
              " equal chunks");
  return t.index_select(dim, positions(seq / group_.size, t.device()));
}

std::shared_ptr<ContextParallel> apply_context_parallel(models::Model& model, const std::vector<models::Root>& roots,
                                                        Group& group, const ContextParallelConfig& options,
                                                        Placements& placements) {
  nn::SequenceSlot* slot = model.sequence_slot();
  TORCH_CHECK(slot, "context_parallel: the model has no attention it can split over the sequence");
  auto cp = std::make_shared<ContextParallel>(group, options);
  slot->split = cp;
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : models::root_parameters(roots)) {
    // Every rank draws the same values; a model built on meta has none to send yet.
    if (group.pg && !p.is_meta()) broadcast(group, p, 0);
    placements.add(p, {group.name, &group, group.size, group.rank, Placement::replicate(),
                       Placement::partial(Reduce::kAvg)});
  }
  return cp;
}

bool apply(Applying& a, const ContextParallelConfig& config) {
  Group& group = a.group(config.mesh_dim);
  a.par.cp = apply_context_parallel(a.model, a.par.roots, group, config, *a.par.placements);
  a.log("applied context_parallel " + over(&group) + ": " + name_of(config.rotate) + " attention, " +
        (config.load_balance ? "load-balanced chunks" : "contiguous slices"));
  return true;
}

void trace(Tracing& t, const ContextParallelConfig& config) {
  t.input = ContextParallel(t.group(config.mesh_dim), config).slice(t.input, 1);
}

}  // namespace composer::parallel

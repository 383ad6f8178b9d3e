#include "runner/verify/diff.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>
#include <string_view>

#include "parallelisms/comm/collectives.h"
#include "runner/base/errors.h"
#include "runner/base/safetensors.h"

namespace composer {
namespace {

// One recorded piece, its tensor read from disk when compared.
struct Piece {
  RecordEntry e;
  int rank = 0;
  double grad_divisor = 1;
  std::string file;         // one tensor
  SafetensorsEntry stored;  // its header entry, read once
  const std::vector<int64_t>& shape() const { return stored.shape; }
  torch::Tensor load() const { return read_safetensors_tensor(file, stored).to(torch::kDouble); }
};

struct Side {
  int64_t step = 0, global_batch = 0, seq_len = 0, local_batch = 0;
  std::vector<Piece> pieces;
};

// The rank<r>.json files in `dir`, sorted.
std::vector<std::string> rank_files(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = f.path().filename().string();
    if (n.rfind("rank", 0) == 0 && f.path().extension() == ".json") files.push_back(f.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

Side read_side(const std::string& dir) {
  const auto files = rank_files(dir);
  if (files.empty()) throw RuntimeFailure("composer diff: no rank recorded anything in " + dir);
  Side s;
  for (const auto& path : files) {
    std::ifstream in(path);
    const auto r = nlohmann::json::parse(in).get<RankRecord>();
    s.step = r.step;
    s.global_batch = r.global_batch;
    s.seq_len = r.seq_len;
    s.local_batch = r.local_batch;
    for (const auto& e : r.entries) {
      const std::string file = dir + "/" + e.file;
      s.pieces.push_back({e, r.rank, r.grad_divisor, file, read_safetensors_entries(file).at(0)});
    }
  }
  return s;
}

// "8..15" or "0..3, 12..15": a sorted index list as runs.
std::string runs(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(v[i]) + (j > i ? ".." + std::to_string(v[j]) : "");
    i = j + 1;
  }
  return out;
}

// The part of the whole tensor that a piece holds: an index per dim and its
// description, or (in `why`) the reason it cannot be placed.
struct Region {
  std::vector<torch::Tensor> index;  // int64 per dim
  std::string where, why;
};

Region place_param(const PiecePlace& w, const torch::Tensor& whole, at::IntArrayRef shape) {
  Region r;
  if (!w.box) {
    r.why = "carries no box of the whole parameter";
    return r;
  }
  const auto& offset = w.box->offset;
  const auto& size = w.box->size;
  if (size != shape.vec() || static_cast<int64_t>(size.size()) != whole.dim()) {
    r.why = "its piece's shape does not fit the whole parameter";
    return r;
  }
  std::ostringstream os;
  os << (w.box->placement.empty() ? "" : w.box->placement + ", ") << "box offset [";
  for (size_t d = 0; d < size.size(); ++d) {
    if (offset[d] + size[d] > whole.size(d)) {
      r.why = "its box lies outside the whole parameter";
      return r;
    }
    r.index.push_back(torch::arange(offset[d], offset[d] + size[d], torch::kLong));
    os << (d ? ", " : "") << offset[d];
  }
  os << "]";
  r.where = os.str();
  return r;
}

// An activation piece being placed dim by dim: what it says of itself, the
// step's batch and sequence, and the region found so far.
struct Placing {
  const PiecePlace& w;
  int64_t global_batch = 0, seq = 0;
  int tp_rank = 0, tp = 1;
  Region r;
  std::ostringstream os;        // r.where, as it grows
  bool tokens_in_rows = false;  // the samples' dim holds their tokens at the cp positions
};

// The samples' dim `d`: `mine` rows of the whole's `all`, each sample one row
// or its tokens flattened into dim 0 (under cp: the tokens at its positions).
void place_samples(Placing& p, int64_t d, int64_t all, int64_t mine) {
  const int64_t b0 = p.w.first_sample, n = p.w.samples;
  const auto& pos = p.w.positions;
  if (p.global_batch <= 0 || all % p.global_batch != 0) {
    p.r.why = "dim " + std::to_string(d) + " does not hold the global batch's samples";
    return;
  }
  const int64_t per_sample = all / p.global_batch;
  // Rows flattened into dim 0 are placed only as each sample's tokens
  // (sample-major); other interleavings cannot be told apart by shape.
  if (d == 0 && per_sample != 1 && per_sample != p.seq) {
    p.r.why = "dim 0 holds " + std::to_string(per_sample) + " rows per sample, not 1 or its tokens";
    return;
  }
  auto samples = torch::arange(b0, b0 + n, torch::kLong);
  if (mine == n * per_sample) {
    p.r.index.push_back((samples.unsqueeze(1) * per_sample + torch::arange(per_sample, torch::kLong)).flatten());
  } else if (!pos.empty() && per_sample == p.seq && mine == n * static_cast<int64_t>(pos.size())) {
    p.r.index.push_back((samples.unsqueeze(1) * p.seq + torch::tensor(pos, torch::kLong).unsqueeze(0)).flatten());
    p.os << " (rows: their tokens at positions " << runs(pos) << ")";
    p.tokens_in_rows = true;
  } else {
    p.r.why = "dim " + std::to_string(d) + " holds " + std::to_string(mine) + " rows, not its " + std::to_string(n) +
              " samples'";
  }
}

// The sequence dim `d` under context parallelism: the rank's positions, or
// its tensor-parallel chunk of them (sequence parallelism after cp).
void place_positions(Placing& p, int64_t d, int64_t mine) {
  const auto& pos = p.w.positions;
  auto index = torch::tensor(pos, torch::kLong);
  const int64_t len = static_cast<int64_t>(pos.size());
  const std::string cp = "cp rank " + std::to_string(p.w.cp->rank) + " of " + std::to_string(p.w.cp->size);
  if (mine == len) {
    p.r.index.push_back(index);
    p.os << ", sequence positions " << runs(pos) << " (" << cp << ")";
    return;
  }
  const auto sizes = parallel::chunk_sizes(len, p.tp);
  if (p.tp > 1 && mine == sizes[p.tp_rank]) {
    index = index.narrow(0, parallel::offset_of(sizes, p.tp_rank), mine).contiguous();
    p.r.index.push_back(index);
    p.os << ", sequence positions "
         << runs(std::vector<int64_t>(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + mine)) << " (" << cp
         << ", then tp rank " << p.tp_rank << " of " << p.tp << ")";
    return;
  }
  p.r.why = "dim " + std::to_string(d) + " holds " + std::to_string(mine) +
            " positions, not its context-parallel slice's " + std::to_string(len);
}

// Any other dim: whole, or the rank's tensor-parallel torch.chunk piece.
void place_whole_or_chunk(Placing& p, int64_t d, int64_t all, int64_t mine) {
  if (mine == all) {
    p.r.index.push_back(torch::arange(all, torch::kLong));
    return;
  }
  const auto sizes = parallel::chunk_sizes(all, p.tp);
  if (p.tp > 1 && mine == sizes[p.tp_rank]) {
    const int64_t off = parallel::offset_of(sizes, p.tp_rank);
    p.r.index.push_back(torch::arange(off, off + mine, torch::kLong));
    p.os << ", dim " << d << " " << off << ".." << off + mine - 1 << " of " << all << " (tp rank " << p.tp_rank
         << " of " << p.tp << ")";
    return;
  }
  p.r.why = "dim " + std::to_string(d) + " holds " + std::to_string(mine) + " of " + std::to_string(all) +
            " and no placement of this rank gives that";
}

// `batch_dim`: the dim that holds the samples (0, or 1 for a sequence-first
// layout), or -1 for a tensor without one (position embeddings), the same for
// every sample. The sequence dim is the other of 0 and 1.
Region place_activation(const PiecePlace& w, const torch::Tensor& whole, at::IntArrayRef shape, int64_t global_batch,
                        int64_t seq, int64_t batch_dim) {
  Placing p{w, global_batch, seq};
  if (w.tp) {
    p.tp_rank = w.tp->rank;
    p.tp = w.tp->size;
  }
  if (shape.size() != static_cast<size_t>(whole.dim()) || whole.dim() == 0) {
    p.r.why = "its shape does not fit the whole tensor's";
    return std::move(p.r);
  }
  p.os << (batch_dim < 0
               ? "every sample"
               : "samples " + std::to_string(w.first_sample) + ".." + std::to_string(w.first_sample + w.samples - 1));
  const int64_t seq_dim = batch_dim == 0 ? 1 : 0;
  for (int64_t d = 0; d < whole.dim() && p.r.why.empty(); ++d) {
    const int64_t all = whole.size(d), mine = shape[d];
    if (d == batch_dim) {
      place_samples(p, d, all, mine);
    } else if (d == seq_dim && !w.positions.empty() && !p.tokens_in_rows && all == seq && mine != all) {
      place_positions(p, d, mine);
    } else {
      place_whole_or_chunk(p, d, all, mine);
    }
  }
  if (!p.r.why.empty()) return std::move(p.r);
  if (p.tp > 1 && p.os.str().find("tp rank") == std::string::npos) p.os << ", the same on every tp rank";
  p.r.where = p.os.str();
  return std::move(p.r);
}

torch::Tensor select(torch::Tensor t, const std::vector<torch::Tensor>& index) {
  for (size_t d = 0; d < index.size(); ++d) t = t.index_select(static_cast<int64_t>(d), index[d]);
  return t;
}

void mark(torch::Tensor& covered, const std::vector<torch::Tensor>& index) {
  std::vector<at::indexing::TensorIndex> idx;
  for (size_t d = 0; d < index.size(); ++d) {
    std::vector<int64_t> shape(index.size(), 1);
    shape[d] = index[d].numel();
    idx.emplace_back(index[d].view(shape));
  }
  covered.index_put_(idx, true);
}

double max_abs(const torch::Tensor& t) {
  if (t.numel() == 0) return 0;
  if (!torch::isfinite(t).all().item<bool>()) return INFINITY;
  return t.abs().max().item<double>();
}

// A compared tensor: its kind and module. Ordered by the kind's name, then
// the module, the order the report's "not compared" list has always had.
struct TensorKey {
  RecordKind kind;
  std::string module;
  bool operator<(const TensorKey& o) const {
    const int c = std::string_view(name_of(kind)).compare(name_of(o.kind));
    return c != 0 ? c < 0 : module < o.module;
  }
  std::string label() const { return (module.empty() ? "(the model)" : module) + " " + name_of(kind); }
};
using PiecesByTensor = std::map<TensorKey, std::vector<const Piece*>>;

PiecesByTensor by_tensor(const Side& side) {
  PiecesByTensor out;
  for (const auto& p : side.pieces) out[{p.e.kind, p.e.module}].push_back(&p);
  return out;
}

// The single device's records: each tensor's pieces (one per microbatch, in
// microbatch order), its execution order (microbatch 0's), and each module's
// forward calls per microbatch.
struct Reference {
  PiecesByTensor pieces;
  std::map<TensorKey, int64_t> order;
  std::map<std::string, int64_t> calls;
};

Reference index_reference(const Side& one) {
  Reference ref;
  ref.pieces = by_tensor(one);
  for (auto& [k, pieces] : ref.pieces) {
    ref.order[k] = pieces.front()->e.order;  // the first recorded, microbatch 0's
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece* a, const Piece* b) { return a->e.microbatch < b->e.microbatch; });
    if (k.kind != RecordKind::kOutput) continue;
    for (const Piece* p : pieces) ref.calls[k.module] = std::max(ref.calls[k.module], p->e.calls);
  }
  return ref;
}

// The single device's whole tensor, and the dim of its samples (-1: none);
// undefined, with the reason, when no layout places the plan's first piece.
struct Whole {
  torch::Tensor t;
  int64_t batch_dim = -1;
  std::string why;
};

// An activation's microbatches joined along the samples' dim, the first of
// these that places the plan's first piece: 0 (each microbatch's samples, or
// their tokens flattened), 1 (a sequence-first layout), none (the same for
// every sample: microbatch 0's is the whole, as position embeddings).
Whole whole_activation(const std::vector<const Piece*>& singles, const Piece& first, const Side& plan) {
  std::vector<torch::Tensor> parts;
  for (const Piece* s : singles) parts.push_back(s->load());
  Whole out;
  for (int64_t d : {0, 1, -1}) {
    bool fits = true;
    for (size_t i = 0; i < parts.size() && d >= 0; ++i) {
      fits = fits && parts[i].dim() > d && parts[i].size(d) % singles[i]->e.where.samples == 0;
    }
    // No batch dim: then every microbatch's tensor is the same.
    for (size_t i = 1; i < parts.size() && d < 0; ++i) fits = fits && parts[i].equal(parts[0]);
    if (!fits) continue;
    torch::Tensor w = d < 0 || parts.size() == 1 ? parts[0] : torch::cat(parts, d);
    const Region r = place_activation(first.e.where, w, first.shape(), plan.global_batch, plan.seq_len, d);
    if (r.why.empty()) return {w, d, ""};
    if (out.why.empty()) out.why = r.why;
  }
  if (out.why.empty()) out.why = "fits no layout (batch-first, sequence-first, or the same for every sample)";
  return out;
}

// Where the step runs a tensor of this kind: parameters before it, the
// microbatches' activations, the synchronised gradients, the update.
int phase_of(RecordKind k) {
  switch (k) {
    case RecordKind::kParamBefore:
      return 0;
    case RecordKind::kParamGrad:
      return 2;
    case RecordKind::kParamAfter:
      return 3;
    default:
      return 1;
  }
}

// One tensor's comparison: the plan's entries by microbatch, and which of the
// whole's elements some rank's piece holds.
struct TensorDiff {
  TensorKey key;
  std::string type;
  int64_t order = 0;
  Whole whole;
  double scale = 0;
  torch::Tensor covered;
  std::map<int64_t, DiffEntry> by_mb;

  DiffEntry& entry(int64_t mb) {
    auto [it, added] = by_mb.try_emplace(mb);
    DiffEntry& d = it->second;
    if (added) {
      d.kind = key.kind;
      d.name = key.module;
      d.type = type;
      d.microbatch = mb;
      d.scale = scale;
      // Input gradients are recorded in backward's order; the synchronised
      // gradients in the model's, which backward reverses.
      d.order = key.kind == RecordKind::kParamGrad ? -order : order;
    }
    return d;
  }
};

// Compares the plan's piece `p` with its part of the whole: the tolerances are the report's.
void compare_piece(TensorDiff& t, const Piece& p, const Side& plan, const DiffReport& tol) {
  DiffEntry& d = t.entry(p.e.microbatch);
  d.holders.push_back(p.rank);
  torch::Tensor piece = p.load();
  const Region r = is_param(t.key.kind) ? place_param(p.e.where, t.whole.t, piece.sizes())
                                        : place_activation(p.e.where, t.whole.t, piece.sizes(), plan.global_batch,
                                                           plan.seq_len, t.whole.batch_dim);
  if (!r.why.empty()) {
    d.diverges = true;
    d.ranks.push_back(p.rank);
    if (d.problem.empty()) d.problem = "rank " + std::to_string(p.rank) + "'s piece " + r.why;
    d.max_abs = INFINITY;
    return;
  }
  if (t.key.kind == RecordKind::kInputGrad) piece = piece / p.grad_divisor;
  const torch::Tensor want = select(t.whole.t, r.index);
  const double err = max_abs(piece - want);
  mark(t.covered, r.index);
  const bool off = is_param_value(t.key.kind)
                       ? !((piece - want).abs() <= tol.param_atol + tol.param_rtol * want.abs()).all().item<bool>()
                       : !(err <= tol.rtol * t.scale);
  if (off) {
    if (!d.diverges || d.where.empty()) d.where = "rank " + std::to_string(p.rank) + ": " + r.where;
    d.diverges = true;
    d.ranks.push_back(p.rank);
  } else if (d.where.empty()) {
    d.where = "rank " + std::to_string(p.rank) + ": " + r.where;
  }
  d.max_abs = std::max(d.max_abs, err);
}

// Elements no rank's piece holds, counted by the plan's microbatch that
// should have computed them (a parameter's, or a tensor without a batch dim:
// 0); each such microbatch's entry diverges.
void note_missing(TensorDiff& t, const Piece& first, const Side& plan) {
  const int64_t n = t.covered.numel() - t.covered.sum().item<int64_t>();
  if (n == 0) return;
  std::map<int64_t, int64_t> missing;
  const int64_t batch_dim = t.whole.batch_dim;
  const int64_t micro = batch_dim >= 0 ? first.e.where.samples : 0;
  if (batch_dim >= 0 && plan.local_batch > 0 && micro > 0) {
    const int64_t per_sample = t.whole.t.size(batch_dim) / plan.global_batch;
    auto rows = t.covered.logical_not().nonzero().select(1, batch_dim);
    auto mbs = ((rows.div(per_sample, "floor") % plan.local_batch).div(micro, "floor")).contiguous();
    for (int64_t i = 0; i < mbs.numel(); ++i) ++missing[mbs.data_ptr<int64_t>()[i]];
  } else {
    missing[0] = n;
  }
  for (const auto& [mb, count] : missing) {
    DiffEntry& d = t.entry(mb);
    d.diverges = true;
    if (d.problem.empty())
      d.problem = std::to_string(count) + " of the elements this microbatch computes are in no rank's piece";
  }
}

void add_entries(TensorDiff& t, DiffReport& out) {
  for (auto& [mb, d] : t.by_mb) {
    d.rel = d.scale > 0 ? d.max_abs / d.scale : (d.max_abs > 0 ? INFINITY : 0);
    std::sort(d.holders.begin(), d.holders.end());
    d.holders.erase(std::unique(d.holders.begin(), d.holders.end()), d.holders.end());
    out.entries.push_back(std::move(d));
  }
}

// Compares tensor `k`: one device's pieces `singles` with the plan's
// `pieces`, adding its entries to `out`, or the reason it is not compared.
void compare_tensor(const TensorKey& k, const std::vector<const Piece*>& singles,
                    const std::vector<const Piece*>& pieces, const Reference& ref, const Side& plan, DiffReport& out) {
  const auto calls = ref.calls.find(k.module);
  if (!is_param(k.kind) && calls != ref.calls.end() && calls->second > 1) {
    out.not_compared.push_back(k.label() + ": called " + std::to_string(calls->second) +
                               " times in a microbatch (the first call of each is recorded)");
    return;
  }
  const Piece& first = *pieces.front();
  TensorDiff t{k, first.e.type, ref.order.at(k)};
  t.whole = is_param(k.kind) ? Whole{singles.front()->load()} : whole_activation(singles, first, plan);
  if (!t.whole.t.defined()) {
    out.not_compared.push_back(k.label() + ": rank " + std::to_string(first.rank) + "'s piece " + t.whole.why);
    return;
  }
  t.scale = max_abs(t.whole.t);
  t.covered = torch::zeros(t.whole.t.sizes(), torch::kBool);
  for (const Piece* p : pieces) compare_piece(t, *p, plan, out);
  note_missing(t, first, plan);
  add_entries(t, out);
}

// The order the step runs tensors in (DiffEntry::order).
bool runs_before(const DiffEntry& a, const DiffEntry& b) {
  const int pa = phase_of(a.kind), pb = phase_of(b.kind);
  if (pa != pb) return pa < pb;
  if (pa == 1 && a.microbatch != b.microbatch) return a.microbatch < b.microbatch;
  const int da = a.kind == RecordKind::kInputGrad, db = b.kind == RecordKind::kInputGrad;
  if (da != db) return da < db;
  return a.order < b.order;
}

}  // namespace

std::string DiffEntry::direction() const {
  switch (kind) {
    case RecordKind::kOutput:
      return "forward";
    case RecordKind::kInputGrad:
    case RecordKind::kParamGrad:
      return "backward";
    case RecordKind::kParamBefore:
      return "before the step";
    case RecordKind::kParamAfter:
      return "update";
  }
  return "?";
}

std::string DiffEntry::tensor() const {
  switch (kind) {
    case RecordKind::kOutput:
      return "output";
    case RecordKind::kInputGrad:
      return "gradient into its input";
    case RecordKind::kParamGrad:
      return "gradient, synchronised";
    case RecordKind::kParamBefore:
      return "value before the step";
    case RecordKind::kParamAfter:
      return "value after the update";
  }
  return "?";
}

int DiffReport::diverging() const {
  return static_cast<int>(std::count_if(entries.begin(), entries.end(), [](const DiffEntry& e) { return e.diverges; }));
}

const DiffEntry* DiffReport::first() const {
  for (const auto& e : entries) {
    if (e.diverges) return &e;
  }
  return nullptr;
}

const DiffEntry* DiffReport::worst() const {
  const DiffEntry* w = nullptr;
  for (const auto& e : entries) {
    if (is_param_value(e.kind)) continue;  // judged element by element
    if (!w || e.rel > w->rel) w = &e;
  }
  return w;
}

DiffReport diff_records(const std::string& single_dir, const std::string& plan_dir, double rtol, double param_rtol,
                        double param_atol) {
  const Side one = read_side(single_dir), plan = read_side(plan_dir);
  DiffReport out;
  out.step = plan.step;
  out.rtol = rtol;
  out.param_rtol = param_rtol;
  out.param_atol = param_atol;
  const Reference ref = index_reference(one);
  const PiecesByTensor pieces_of = by_tensor(plan);
  for (const auto& [k, pieces] : pieces_of) {
    if (!ref.pieces.count(k)) out.not_compared.push_back(k.label() + ": recorded by the plan only");
  }
  for (const auto& [k, singles] : ref.pieces) {
    const auto found = pieces_of.find(k);
    if (found == pieces_of.end()) {
      out.not_compared.push_back(k.label() + ": recorded on one device only");
      continue;
    }
    compare_tensor(k, singles, found->second, ref, plan, out);
  }
  std::stable_sort(out.entries.begin(), out.entries.end(), runs_before);
  return out;
}

namespace {

std::string fmt(double v) {
  std::ostringstream os;
  os << std::setprecision(3) << v;
  return os.str();
}

std::string ranks_text(const std::vector<int>& r) {
  std::string s;
  for (int x : r) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

std::string label(const DiffEntry& e) {
  return (e.name.empty() ? "(the model)" : e.name) + (e.type.empty() ? "" : " (" + e.type + ")");
}

}  // namespace

nlohmann::json DiffReport::to_json() const {
  nlohmann::json j = {{"step", step},
                      {"rtol", rtol},
                      {"param_rtol", param_rtol},
                      {"param_atol", param_atol},
                      {"compared", entries.size()},
                      {"diverging", diverging()}};
  auto one = [](const DiffEntry& e) {
    const std::string kind = name_of(e.kind);
    return nlohmann::json{{"kind", kind},
                          {"module", e.name},
                          {"type", e.type},
                          {"microbatch", e.microbatch},
                          {"direction", e.direction()},
                          {"tensor", e.tensor()},
                          {"max_abs_err", e.max_abs},
                          {"max_abs", e.scale},
                          {"rel_err", e.rel},
                          {"diverges", e.diverges},
                          {"ranks", e.ranks},
                          {"holders", e.holders},
                          {"where", e.where},
                          {"problem", e.problem}};
  };
  j["first"] = first() ? one(*first()) : nlohmann::json();
  j["worst"] = worst() ? one(*worst()) : nlohmann::json();
  j["divergences"] = nlohmann::json::array();
  for (const auto& e : entries) {
    if (e.diverges) j["divergences"].push_back(one(e));
  }
  j["not_compared"] = not_compared;
  return j;
}

void print_diff(std::ostream& os, const DiffReport& r, const std::string& what, int more) {
  os << "diff: step " << r.step << " of " << what << ": " << r.entries.size() << " tensors compared, " << r.diverging()
     << " diverge (an activation or gradient matches when max |plan - one device| <= " << fmt(r.rtol)
     << " x max |one device|, a parameter when each element is within " << fmt(r.param_atol) << " + "
     << fmt(r.param_rtol) << " x |one device|)\n";
  if (!r.not_compared.empty()) {
    os << "  not compared: " << r.not_compared.size() << " (";
    for (size_t i = 0; i < std::min<size_t>(3, r.not_compared.size()); ++i) os << (i ? "; " : "") << r.not_compared[i];
    os << (r.not_compared.size() > 3 ? "; ... (report.json lists them)" : "") << ")\n";
  }
  const DiffEntry* f = r.first();
  if (!f) {
    const DiffEntry* w = r.worst();
    os << "no divergence: every compared output, input gradient, parameter and gradient matches";
    if (w) {
      os << "; the closest to its tolerance: " << label(*w) << " " << w->tensor() << " (" << w->direction()
         << ", microbatch " << w->microbatch << "), rel err " << fmt(w->rel);
    }
    os << "\n";
    return;
  }
  os << "first divergence: step " << r.step << ", microbatch " << f->microbatch << ", " << f->direction() << ": "
     << label(*f) << " " << f->tensor() << "\n";
  if (!f->problem.empty()) os << "  " << f->problem << "\n";
  os << "  max abs err " << fmt(f->max_abs) << ", rel err " << fmt(f->rel) << " (max |one device| " << fmt(f->scale)
     << ")\n";
  if (f->ranks.empty()) {
    os << "  no rank's piece differs: elements are missing (pieces on ranks " << ranks_text(f->holders) << ")\n";
  } else {
    os << "  differs on rank" << (f->ranks.size() > 1 ? "s " : " ") << ranks_text(f->ranks) << " (pieces on ranks "
       << ranks_text(f->holders) << "); " << f->where << "\n";
  }
  const int total = r.diverging() - 1;
  if (total <= 0) return;
  os << "next divergences (" << std::min(more, total) << " of " << total << ", in execution order):\n";
  os << "  " << std::left << std::setw(4) << "mb" << std::setw(17) << "direction" << std::setw(64) << "tensor"
     << std::setw(11) << "max abs" << std::setw(11) << "rel"
     << "ranks\n";
  int shown = 0;
  for (const auto& e : r.entries) {
    if (!e.diverges || &e == f) continue;
    if (shown++ == more) break;
    os << "  " << std::left << std::setw(4) << e.microbatch << std::setw(17) << e.direction() << std::setw(64)
       << (label(e) + " " + e.tensor()) << std::setw(11) << fmt(e.max_abs) << std::setw(11) << fmt(e.rel)
       << ranks_text(e.ranks) << "\n";
  }
}

}  // namespace composer

#include "runner/verify/diff.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include "parallelisms/comm/collectives.h"
#include "runner/base/errors.h"
#include "runner/base/safetensors.h"

namespace composer {
namespace {

// One recorded piece, its tensor read from disk when compared.
struct Piece {
  nlohmann::json e;  // the entry: key, kind, module, type, microbatch, order, where
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

Side read_side(const std::string& dir) {
  Side s;
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& f : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = f.path().filename().string();
    if (n.rfind("rank", 0) == 0 && f.path().extension() == ".json") files.push_back(f.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw RuntimeFailure("composer diff: no rank recorded anything in " + dir);
  for (const auto& path : files) {
    std::ifstream in(path);
    nlohmann::json j = nlohmann::json::parse(in);
    s.step = j["step"];
    s.global_batch = j["global_batch"];
    s.seq_len = j["seq_len"];
    s.local_batch = j.value("local_batch", int64_t{0});
    for (auto& e : j["entries"]) {
      const std::string file = dir + "/" + e["file"].get<std::string>();
      s.pieces.push_back(
          {e, j["rank"].get<int>(), j["grad_divisor"].get<double>(), file, read_safetensors_entries(file).at(0)});
    }
  }
  return s;
}

bool is_param(const std::string& kind) { return kind.rfind("param_", 0) == 0; }

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

// The part of the whole tensor `whole` that piece `p` (shape `shape`) holds:
// an index per dim (or "" in *why when it cannot be placed), and its description.
struct Region {
  std::vector<torch::Tensor> index;  // int64 per dim
  std::string where, why;
};

Region place_param(const nlohmann::json& w, const torch::Tensor& whole, at::IntArrayRef shape) {
  Region r;
  const auto offset = w["offset"].get<std::vector<int64_t>>(), size = w["size"].get<std::vector<int64_t>>();
  if (size != shape.vec() || static_cast<int64_t>(size.size()) != whole.dim()) {
    r.why = "its piece's shape does not fit the whole parameter";
    return r;
  }
  std::ostringstream os;
  os << (w.contains("placement") ? w["placement"].get<std::string>() + ", " : "") << "box offset [";
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

// `batch_dim`: the dim that holds the samples (0, or 1 for a sequence-first
// layout), or -1 for a tensor without one (position embeddings), the same for
// every sample.
Region place_activation(const nlohmann::json& w, const torch::Tensor& whole, at::IntArrayRef shape,
                        int64_t global_batch, int64_t seq, int64_t batch_dim) {
  Region r;
  const int64_t b0 = w["samples"][0], n = w["samples"][1];
  std::vector<int64_t> pos;
  if (w.contains("positions")) pos = w["positions"].get<std::vector<int64_t>>();
  int tp_rank = 0, tp = 1;
  if (w.contains("tp")) tp_rank = w["tp"][0], tp = w["tp"][1];
  std::ostringstream os;
  if (shape.size() != static_cast<size_t>(whole.dim()) || whole.dim() == 0) {
    r.why = "its shape does not fit the whole tensor's";
    return r;
  }
  os << (batch_dim < 0 ? "every sample" : "samples " + std::to_string(b0) + ".." + std::to_string(b0 + n - 1));
  const int64_t seq_dim = batch_dim == 0 ? 1 : 0;
  bool tokens_in_rows = false;
  for (int64_t d = 0; d < whole.dim(); ++d) {
    const int64_t all = whole.size(d), mine = shape[d];
    if (d == batch_dim) {
      // Rows per sample: 1, or each sample's tokens when flattened into dim 0.
      if (global_batch <= 0 || all % global_batch != 0) {
        r.why = "dim " + std::to_string(d) + " does not hold the global batch's samples";
        return r;
      }
      const int64_t per_sample = all / global_batch;
      // Rows flattened into dim 0 are placed only as each sample's tokens
      // (sample-major); other interleavings cannot be told apart by shape.
      if (d == 0 && per_sample != 1 && per_sample != seq) {
        r.why = "dim 0 holds " + std::to_string(per_sample) + " rows per sample, not 1 or its tokens";
        return r;
      }
      auto samples = torch::arange(b0, b0 + n, torch::kLong);
      if (mine == n * per_sample) {
        r.index.push_back((samples.unsqueeze(1) * per_sample + torch::arange(per_sample, torch::kLong)).flatten());
      } else if (!pos.empty() && per_sample == seq && mine == n * static_cast<int64_t>(pos.size())) {
        r.index.push_back((samples.unsqueeze(1) * seq + torch::tensor(pos, torch::kLong).unsqueeze(0)).flatten());
        os << " (rows: their tokens at positions " << runs(pos) << ")";
        tokens_in_rows = true;
      } else {
        r.why = "dim " + std::to_string(d) + " holds " + std::to_string(mine) + " rows, not its " + std::to_string(n) +
                " samples'";
        return r;
      }
      continue;
    }
    if (d == seq_dim && !pos.empty() && !tokens_in_rows && all == seq && mine != all) {
      auto p = torch::tensor(pos, torch::kLong);
      const int64_t len = static_cast<int64_t>(pos.size());
      if (mine == len) {
        r.index.push_back(p);
        os << ", sequence positions " << runs(pos) << " (cp rank " << w["cp"][0] << " of " << w["cp"][1] << ")";
        continue;
      }
      const auto sizes = parallel::chunk_sizes(len, tp);
      if (tp > 1 && mine == sizes[tp_rank]) {
        p = p.narrow(0, parallel::offset_of(sizes, tp_rank), mine).contiguous();
        r.index.push_back(p);
        os << ", sequence positions " << runs(std::vector<int64_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + mine))
           << " (cp rank " << w["cp"][0] << " of " << w["cp"][1] << ", then tp rank " << tp_rank << " of " << tp << ")";
        continue;
      }
      r.why = "dim " + std::to_string(d) + " holds " + std::to_string(mine) +
              " positions, not its context-parallel slice's " + std::to_string(len);
      return r;
    }
    if (mine == all) {
      r.index.push_back(torch::arange(all, torch::kLong));
      continue;
    }
    const auto sizes = parallel::chunk_sizes(all, tp);
    if (tp > 1 && mine == sizes[tp_rank]) {
      const int64_t off = parallel::offset_of(sizes, tp_rank);
      r.index.push_back(torch::arange(off, off + mine, torch::kLong));
      os << ", dim " << d << " " << off << ".." << off + mine - 1 << " of " << all << " (tp rank " << tp_rank << " of "
         << tp << ")";
      continue;
    }
    r.why = "dim " + std::to_string(d) + " holds " + std::to_string(mine) + " of " + std::to_string(all) +
            " and no placement of this rank gives that";
    return r;
  }
  if (tp > 1 && os.str().find("tp rank") == std::string::npos) os << ", the same on every tp rank";
  r.where = os.str();
  return r;
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

}  // namespace

std::string DiffEntry::direction() const {
  if (kind == "output") return "forward";
  if (kind == "input_grad" || kind == "param_grad") return "backward";
  return kind == "param_before" ? "before the step" : "update";
}

std::string DiffEntry::tensor() const {
  if (kind == "output") return "output";
  if (kind == "input_grad") return "gradient into its input";
  if (kind == "param_grad") return "gradient, synchronised";
  return kind == "param_before" ? "value before the step" : "value after the update";
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
    if (e.kind == "param_before" || e.kind == "param_after") continue;  // judged element by element
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
  // The single device's pieces by (kind, name): microbatches in order; its
  // execution order by (kind, name) from microbatch 0.
  std::map<std::pair<std::string, std::string>, std::vector<const Piece*>> whole_of;
  std::map<std::pair<std::string, std::string>, int64_t> order_of;
  std::map<std::string, int64_t> calls_of;  // forward calls per microbatch, by module, on one device
  for (const auto& p : one.pieces) {
    const std::pair<std::string, std::string> k{p.e["kind"], p.e["module"]};
    if (k.first == "output") {
      calls_of[k.second] = std::max(calls_of[k.second], p.e.value("calls", int64_t{1}));
    }
    whole_of[k].push_back(&p);
    if (!order_of.count(k)) order_of[k] = p.e["order"];
  }
  std::map<std::pair<std::string, std::string>, std::vector<const Piece*>> pieces_of;
  for (const auto& p : plan.pieces) pieces_of[{p.e["kind"], p.e["module"]}].push_back(&p);
  for (const auto& [k, pieces] : pieces_of) {
    if (!whole_of.count(k)) {
      out.not_compared.push_back((k.second.empty() ? "(the model)" : k.second) + " " + k.first +
                                 ": recorded by the plan only");
    }
  }
  for (auto& [k, singles] : whole_of) {
    const auto& [kind, name] = k;
    auto found = pieces_of.find(k);
    if (found == pieces_of.end()) {
      out.not_compared.push_back((name.empty() ? "(the model)" : name) + " " + kind + ": recorded on one device only");
      continue;
    }
    std::sort(singles.begin(), singles.end(), [](const Piece* a, const Piece* b) {
      return a->e["microbatch"].get<int64_t>() < b->e["microbatch"].get<int64_t>();
    });
    const std::string label = (name.empty() ? "(the model)" : name) + " " + kind;
    const int64_t calls = is_param(kind) ? 1 : std::max<int64_t>(1, calls_of[name]);
    if (calls > 1) {
      out.not_compared.push_back(label + ": called " + std::to_string(calls) +
                                 " times in a microbatch (the first call of each is recorded)");
      continue;
    }
    std::vector<torch::Tensor> parts;
    for (const Piece* s : singles) parts.push_back(s->load());
    // The samples' dim, the first of these that places the plan's first
    // piece: 0 (each microbatch's samples, or their tokens flattened), 1 (a
    // sequence-first layout), none (the same for every sample: microbatch 0's
    // is the whole, as position embeddings).
    torch::Tensor whole;
    int64_t batch_dim = -1;
    if (is_param(kind)) {
      whole = parts[0];
    } else {
      const Piece* first = found->second.front();
      std::string why;
      for (int64_t d : {0, 1, -1}) {
        bool fits = true;
        for (size_t i = 0; i < parts.size() && d >= 0; ++i) {
          const int64_t n = singles[i]->e["where"]["samples"][1];
          fits = fits && parts[i].dim() > d && parts[i].size(d) % n == 0;
        }
        // No batch dim: then every microbatch's tensor is the same.
        for (size_t i = 1; i < parts.size() && d < 0; ++i) fits = fits && parts[i].equal(parts[0]);
        if (!fits) continue;
        torch::Tensor w = d < 0 || parts.size() == 1 ? parts[0] : torch::cat(parts, d);
        const Region r = place_activation(first->e["where"], w, first->shape(), plan.global_batch, plan.seq_len, d);
        if (r.why.empty()) {
          whole = w;
          batch_dim = d;
          break;
        }
        if (why.empty()) why = r.why;
      }
      if (!whole.defined()) {
        if (why.empty()) why = "fits no layout (batch-first, sequence-first, or the same for every sample)";
        out.not_compared.push_back(label + ": rank " + std::to_string(first->rank) + "'s piece " + why);
        continue;
      }
    }
    const double scale = max_abs(whole);
    auto covered = torch::zeros(whole.sizes(), torch::kBool);
    std::map<int64_t, DiffEntry> by_mb;  // the plan's microbatches
    auto entry = [&](int64_t mb) -> DiffEntry& {
      DiffEntry& d = by_mb[mb];
      if (d.kind.empty()) {
        d.kind = kind;
        d.name = name;
        d.type = found->second.front()->e["type"];
        d.microbatch = mb;
        d.scale = scale;
        d.phase = kind == "param_before" ? 0 : kind == "param_grad" ? 2 : kind == "param_after" ? 3 : 1;
        // Input gradients are recorded in backward's order; the synchronised
        // gradients in the model's, which backward reverses.
        const int64_t o = order_of[k];
        d.order = kind == "param_grad" ? -o : o;
      }
      return d;
    };
    for (const Piece* p : found->second) {
      const int64_t mb = p->e["microbatch"];
      DiffEntry& d = entry(mb);
      d.holders.push_back(p->rank);
      torch::Tensor piece = p->load();
      const Region r = is_param(kind) ? place_param(p->e["where"], whole, piece.sizes())
                                      : place_activation(p->e["where"], whole, piece.sizes(), plan.global_batch,
                                                         plan.seq_len, batch_dim);
      if (!r.why.empty()) {
        d.diverges = true;
        d.ranks.push_back(p->rank);
        if (d.problem.empty()) d.problem = "rank " + std::to_string(p->rank) + "'s piece " + r.why;
        d.max_abs = INFINITY;
        continue;
      }
      if (kind == "input_grad") piece = piece / p->grad_divisor;
      const torch::Tensor want = select(whole, r.index);
      const double err = max_abs(piece - want);
      mark(covered, r.index);
      const bool value = kind == "param_before" || kind == "param_after";
      const bool off = value ? !((piece - want).abs() <= param_atol + param_rtol * want.abs()).all().item<bool>()
                             : !(err <= rtol * scale);
      if (off) {
        if (!d.diverges || d.where.empty()) d.where = "rank " + std::to_string(p->rank) + ": " + r.where;
        d.diverges = true;
        d.ranks.push_back(p->rank);
      } else if (d.where.empty()) {
        d.where = "rank " + std::to_string(p->rank) + ": " + r.where;
      }
      d.max_abs = std::max(d.max_abs, err);
    }
    // Elements no rank's piece holds, by the plan's microbatch that should
    // have computed them (a parameter's, or a tensor without a batch dim: 0).
    std::map<int64_t, int64_t> missing;
    if (const int64_t n = covered.numel() - covered.sum().item<int64_t>(); n > 0) {
      const int64_t micro = batch_dim >= 0 ? found->second.front()->e["where"]["samples"][1].get<int64_t>() : 0;
      if (batch_dim >= 0 && plan.local_batch > 0 && micro > 0) {
        const int64_t per_sample = whole.size(batch_dim) / plan.global_batch;
        auto rows = covered.logical_not().nonzero().select(1, batch_dim);
        auto mbs = ((rows.div(per_sample, "floor") % plan.local_batch).div(micro, "floor")).contiguous();
        for (int64_t i = 0; i < mbs.numel(); ++i) ++missing[mbs.data_ptr<int64_t>()[i]];
      } else {
        missing[0] = n;
      }
    }
    for (const auto& [mb, n] : missing) {
      DiffEntry& d = entry(mb);
      d.diverges = true;
      if (d.problem.empty())
        d.problem = std::to_string(n) + " of the elements this microbatch computes are in no rank's piece";
    }
    for (auto& [mb, d] : by_mb) {
      d.rel = d.scale > 0 ? d.max_abs / d.scale : (d.max_abs > 0 ? INFINITY : 0);
      std::sort(d.holders.begin(), d.holders.end());
      d.holders.erase(std::unique(d.holders.begin(), d.holders.end()), d.holders.end());
      out.entries.push_back(std::move(d));
    }
  }
  std::stable_sort(out.entries.begin(), out.entries.end(), [](const DiffEntry& a, const DiffEntry& b) {
    if (a.phase != b.phase) return a.phase < b.phase;
    if (a.phase == 1 && a.microbatch != b.microbatch) return a.microbatch < b.microbatch;
    const int da = a.kind == "input_grad", db = b.kind == "input_grad";
    if (da != db) return da < db;
    return a.order < b.order;
  });
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
    return nlohmann::json{{"kind", e.kind},
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

#include "parallelisms/whole_matrix.h"

#include <map>
#include <numeric>
#include <string>

namespace composer::parallel {

namespace {

constexpr int kWholeTag = 4 << 20;  // apart from the rings' and context parallelism's tags

// A mesh dim that splits one of a matrix's own dims (not a stack's dim): the
// holders on it send their pieces to `owner` and get them back from it.
struct Level {
  const SpecDim* dim = nullptr;
  size_t index = 0;  // in the spec's dims
  int64_t tdim = 0;  // the tensor dim it splits
  int owner = 0;     // the group rank that holds the gathered piece
};

}  // namespace

// One matrix's way: the levels it is gathered over, innermost last, with their owners.
struct WholeMatrices::Route {
  const ShardSpec* spec = nullptr;  // null: no placement, whole here
  std::vector<Level> levels;
};

namespace {

// One matrix on its way: its route and what this rank holds of it between
// the gather and the scatter.
struct Matrix {
  const ShardSpec* spec = nullptr;
  const std::vector<Level>& levels;
  int sent_at = -1;               // the level this rank sent its piece at (-1: it owns the whole)
  std::vector<int64_t> sent_shape;
  torch::Tensor whole;            // on the owner, after the gather
};

std::vector<Level> levels_of(const ShardSpec& spec, int batch_dims) {
  std::vector<Level> out;
  for (size_t i : WholeMatrices::splitting_dims(spec, batch_dims)) {
    out.push_back({&spec.dims[i], i, spec.dims[i].param.dim, 0});
  }
  return out;
}

// Owners by cost, largest first, each to the least loaded holder of its
// group shape; every holder computes the same choice from the same list.
void choose_owners(std::vector<WholeMatrices::Route>& ms) {
  std::vector<size_t> order(ms.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> cost(ms.size(), 0);
  for (size_t i = 0; i < ms.size(); ++i) {
    if (ms[i].levels.empty()) continue;  // whole here: no owner to choose
    const auto& g = ms[i].spec->global_shape;
    const int64_t a = g.size() >= 2 ? g[g.size() - 2] : 1, b = g.empty() ? 1 : g.back();
    double batch = 1;
    for (size_t d = 0; d + 2 < g.size(); ++d) batch *= static_cast<double>(g[d]);
    const double m = static_cast<double>(std::min(a, b)), n = static_cast<double>(std::max(a, b));
    cost[i] = batch * m * m * (m + n);  // one Newton-Schulz iteration's products, up to a constant
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost[x] > cost[y]; });
  std::map<std::string, std::vector<double>> loads;  // by the levels' dims and sizes
  for (size_t i : order) {
    auto& levels = ms[i].levels;
    if (levels.empty()) continue;
    std::string key;
    int64_t holders = 1;
    for (const Level& l : levels) {
      key += l.dim->name + "/" + std::to_string(l.dim->size) + "/" + std::to_string(l.tdim) + ";";
      holders *= l.dim->size;
    }
    auto& load = loads[key];
    if (load.empty()) load.assign(static_cast<size_t>(holders), 0.0);
    const size_t best = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[best] += cost[i];
    int64_t rest = static_cast<int64_t>(best);
    for (size_t k = levels.size(); k-- > 0;) {  // the last level varies fastest
      levels[k].owner = static_cast<int>(rest % levels[k].dim->size);
      rest /= levels[k].dim->size;
    }
  }
}

// Innermost level first: a holder that is not a level's owner sends what it
// has to it and is done; the owner joins the pieces and goes on outward.
void gather(Matrix& m, torch::Tensor t) {
  for (size_t k = m.levels.size(); k-- > 0;) {
    const Level& l = m.levels[k];
    Group& g = *l.dim->group;
    if (g.rank != l.owner) {
      m.sent_at = static_cast<int>(k);
      m.sent_shape = t.sizes().vec();
      if (t.numel() > 0) send(g, t.contiguous(), l.owner, kWholeTag);  // an empty torch.chunk piece moves nothing
      return;
    }
    const auto sizes = chunk_sizes(m.spec->box(l.index).size[l.tdim], g.size);
    std::vector<torch::Tensor> pieces;
    for (int r = 0; r < g.size; ++r) {
      if (r == g.rank) {
        pieces.push_back(t);
        continue;
      }
      auto shape = t.sizes().vec();
      shape[l.tdim] = sizes[r];
      torch::Tensor piece = torch::empty(shape, t.options());
      if (piece.numel() > 0) recv(g, piece, r, kWholeTag);
      pieces.push_back(piece);
    }
    t = torch::cat(pieces, l.tdim);
  }
  m.whole = t;
}

// The gather backwards: from the level this rank sent at (or the outermost,
// on the owner) inward, each level's owner sends every holder its piece.
torch::Tensor scatter(const Matrix& m, torch::Tensor t, c10::ScalarType dtype, const torch::TensorOptions& like) {
  const size_t first = m.sent_at < 0 ? 0 : static_cast<size_t>(m.sent_at);
  for (size_t k = first; k < m.levels.size(); ++k) {
    const Level& l = m.levels[k];
    Group& g = *l.dim->group;
    if (static_cast<int>(k) == m.sent_at) {
      t = torch::empty(m.sent_shape, like.dtype(dtype));
      if (t.numel() > 0) recv(g, t, l.owner, kWholeTag);
      continue;
    }
    const auto sizes = chunk_sizes(t.size(l.tdim), g.size);
    torch::Tensor mine;
    for (int r = 0; r < g.size; ++r) {
      torch::Tensor piece = t.narrow(l.tdim, offset_of(sizes, r), sizes[r]);
      if (r == g.rank) {
        mine = piece;
      } else if (piece.numel() > 0) {
        send(g, piece.contiguous(), r, kWholeTag);
      }
    }
    t = mine;
  }
  return t;
}

}  // namespace

std::vector<size_t> WholeMatrices::splitting_dims(const ShardSpec& spec, int batch_dims) {
  std::vector<size_t> out;
  for (size_t i = 0; i < spec.dims.size(); ++i) {
    const SpecDim& d = spec.dims[i];
    if (d.param.is_shard() && d.size > 1 && d.param.dim >= batch_dims) out.push_back(i);
  }
  return out;
}

WholeMatrices::WholeMatrices(const Placements* placements) : placements_(placements) {}
WholeMatrices::~WholeMatrices() = default;

const std::vector<WholeMatrices::Route>& WholeMatrices::routes(const std::vector<torch::Tensor>& params,
                                                               const std::vector<int>& batch_dims) const {
  std::vector<const c10::TensorImpl*> key;
  for (const auto& p : params) key.push_back(p.unsafeGetTensorImpl());
  if (key == routed_) return routes_;
  std::vector<Route> routes(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    routes[i].spec = placements_ ? placements_->find(params[i]) : nullptr;
    if (routes[i].spec) routes[i].levels = levels_of(*routes[i].spec, batch_dims[i]);
  }
  choose_owners(routes);
  routed_ = std::move(key);
  routes_ = std::move(routes);
  return routes_;
}

std::vector<int64_t> WholeMatrices::global_shape(const torch::Tensor& p) const {
  const ShardSpec* spec = placements_ ? placements_->find(p) : nullptr;
  return spec && !spec->global_shape.empty() ? spec->global_shape : p.sizes().vec();
}

std::vector<torch::Tensor> WholeMatrices::apply(const std::vector<torch::Tensor>& params,
                                                const std::vector<torch::Tensor>& locals,
                                                const std::vector<int>& batch_dims, c10::ScalarType result_dtype,
                                                const std::function<torch::Tensor(const torch::Tensor&)>& fn) const {
  TORCH_INTERNAL_ASSERT(params.size() == locals.size() && params.size() == batch_dims.size());
  std::vector<Matrix> ms;
  for (const Route& r : routes(params, batch_dims)) ms.push_back({r.spec, r.levels});
  for (size_t i = 0; i < ms.size(); ++i) {
    gather(ms[i], ms[i].levels.empty() ? locals[i] : locals[i].reshape(ms[i].spec->box().size));
  }
  std::vector<torch::Tensor> out(ms.size());
  for (size_t i = 0; i < ms.size(); ++i) {
    if (ms[i].whole.defined()) out[i] = fn(ms[i].whole).to(result_dtype);
  }
  for (size_t i = 0; i < ms.size(); ++i) {
    out[i] = scatter(ms[i], out[i], result_dtype, locals[i].options()).reshape(locals[i].sizes());
  }
  return out;
}

}  // namespace composer::parallel

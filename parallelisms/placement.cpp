#include "parallelisms/placement.h"

#include <algorithm>
#include <sstream>

namespace composer::parallel {

std::string Placement::str() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kShard: return "S(" + std::to_string(dim) + ")";
    case Kind::kPartial: return reduce == Reduce::kAvg ? "P(avg)" : reduce == Reduce::kMax ? "P(max)" : "P(sum)";
  }
  return "?";
}

bool SpecDim::holds() const { return members.empty() || std::find(members.begin(), members.end(), rank) != members.end(); }

Box ShardSpec::box_at(const std::vector<int>& ranks, size_t levels) const {
  Box b;
  b.size = global_shape.empty() ? std::vector<int64_t>{1} : global_shape;
  b.offset.assign(b.size.size(), 0);
  for (size_t i = 0; i < dims.size() && i < levels; ++i) {
    const SpecDim& d = dims[i];
    if (!d.param.is_shard()) continue;
    const int64_t td = d.param.dim;
    TORCH_INTERNAL_ASSERT(td >= 0 && td < static_cast<int64_t>(b.size.size()), "shard dim ", td, " out of range");
    auto sizes = chunk_sizes(b.size[td], d.size);
    for (int r = 0; r < ranks.at(i); ++r) b.offset[td] += sizes[r];
    b.size[td] = sizes[ranks.at(i)];
  }
  return b;
}

Box ShardSpec::box(size_t levels) const {
  std::vector<int> ranks;
  for (const auto& d : dims) ranks.push_back(d.rank);
  return box_at(ranks, levels);
}

bool ShardSpec::held() const {
  for (const auto& d : dims) {
    if (!d.holds()) return false;
  }
  return true;
}

bool ShardSpec::counts() const {
  for (const auto& d : dims) {
    if (!d.members.empty()) {
      if (d.rank != d.members.front()) return false;
    } else if (!d.param.is_shard() && d.rank != 0) {
      return false;
    }
  }
  return true;
}

bool ShardSpec::split_over(const std::vector<std::string>& names) const {
  return std::any_of(dims.begin(), dims.end(), [&](const SpecDim& d) {
    return d.param.is_shard() && std::find(names.begin(), names.end(), d.name) != names.end();
  });
}

SpecDim* ShardSpec::find(const std::string& name) {
  for (auto& d : dims) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

std::string ShardSpec::str() const {
  std::ostringstream os;
  os << "[" << c10::Join(", ", global_shape) << "]";
  for (const auto& d : dims) {
    os << " " << d.name << ":" << d.param.str();
    if (!(d.grad == d.param)) os << "/" << d.grad.str();
    if (!d.members.empty()) os << "{" << c10::Join(",", d.members) << "}";
  }
  return os.str();
}

ShardSpec& Placements::of(const torch::Tensor& p) {
  auto [it, fresh] = specs_.try_emplace(p.unsafeGetTensorImpl());
  if (fresh) {
    it->second.global_shape = p.sizes().vec();
    it->second.dtype = p.scalar_type();
  }
  return it->second;
}

const ShardSpec* Placements::find(const torch::Tensor& p) const {
  auto it = specs_.find(p.unsafeGetTensorImpl());
  return it == specs_.end() ? nullptr : &it->second;
}

torch::Tensor gather_full(const ShardSpec& spec, const torch::Tensor& local) {
  torch::NoGradGuard no_grad;
  const auto global = spec.global_shape.empty() ? std::vector<int64_t>{1} : spec.global_shape;
  torch::Tensor t;
  if (spec.held()) {
    // Undo the shards innermost first: each level's group shares every other
    // coordinate, so its ranks hold pieces of the same parent box.
    t = local.detach().reshape(spec.box().size);
    for (size_t i = spec.dims.size(); i-- > 0;) {
      const SpecDim& d = spec.dims[i];
      if (!d.param.is_shard() || d.size == 1) continue;
      const int64_t td = d.param.dim;
      const Box parent = spec.box(i);
      t = gather_dim(*d.group, t, td, parent.size[td]).contiguous();
    }
  }
  // Ranks that do not hold it receive it from the first member.
  for (const SpecDim& d : spec.dims) {
    if (d.members.empty() || d.size == 1) continue;
    if (!t.defined()) t = torch::empty(global, torch::TensorOptions().dtype(spec.dtype).device(local.device()));
    t = t.contiguous();
    broadcast(*d.group, t, d.members.front());
  }
  if (!t.defined()) t = torch::empty(global, torch::TensorOptions().dtype(spec.dtype).device(local.device()));
  return t.reshape(spec.global_shape).clone();
}

torch::Tensor local_piece(const ShardSpec& spec, const torch::Tensor& full) {
  const Box b = spec.box();
  torch::Tensor t = spec.global_shape.empty() ? full.reshape({1}) : full;
  for (size_t d = 0; d < b.size.size(); ++d) t = t.narrow(static_cast<int64_t>(d), b.offset[d], b.size[d]);
  return t;
}

void Placements::drop(const std::string& name) {
  drop_unless(name, [](const ShardSpec&) { return false; });
}

void Placements::drop_unless(const std::string& name, const std::function<bool(const ShardSpec&)>& keep) {
  for (auto& [impl, spec] : specs_) {
    if (keep(spec)) continue;
    auto& dims = spec.dims;
    dims.erase(std::remove_if(dims.begin(), dims.end(), [&](const SpecDim& d) { return d.name == name; }), dims.end());
  }
}

}  // namespace composer::parallel

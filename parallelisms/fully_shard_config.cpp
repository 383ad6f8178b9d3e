// fully_shard as a plan configures it: the options a rank runs its Config
// with (groups bound by mesh-dim name, the mixed-precision dtypes, the
// extension, offload on a GPU) and the transform's apply() and trace().
#include "parallelisms/fully_shard.h"
#include "parallelisms/parallel.h"

namespace composer::parallel {

namespace {

// fully_shard's shard dim per parameter under opposite_tp: the dim that an
// earlier transform's Shard placement does not split (PyTorch's
// shard_placement_fn over tensor-parallel shards), else dim 0.
std::function<int64_t(const torch::Tensor&)> opposite_dim(const Placements* placements) {
  return [placements](const torch::Tensor& p) -> int64_t {
    const ShardSpec* spec = placements->find(p);
    if (!spec) return 0;
    for (const auto& d : spec->dims) {
      if (d.param.is_shard()) return p.dim() - 1 - d.param.dim;
    }
    return 0;
  };
}

// The options a rank runs `config` with over `shard` (the last of its dims).
FullyShardOptions rank_options(const Applying& a, const FullyShardConfig& config, Group& shard) {
  FullyShardOptions o;
  o.units = config.units;
  const int64_t n = config.reshard_after_forward.size;
  o.reshard_after_forward = n != 1;
  if (n > 1 && n < shard.size) {  // N consecutive ranks of the shard group
    std::vector<int> members;
    for (int64_t i = shard.rank / n * n; i < (shard.rank / n + 1) * n; ++i) members.push_back(static_cast<int>(i));
    o.post_forward = &a.o.mesh->subgroup(config.mesh_dim.back(), members);
  }
  o.prefetch = config.prefetch;
  if (config.param_dtype) o.param_dtype = scalar_type_of(*config.param_dtype);
  if (config.reduce_dtype) o.reduce_dtype = scalar_type_of(*config.reduce_dtype);
  if (config.all_gather != AllGather::kPlain) o.extension = make_all_gather_extension(lookup(kAllGatherNames, config.all_gather));
  if (config.mesh_dim.size() == 2) o.replicate = &a.group({config.mesh_dim[0]});  // HSDP: [replicate, shard]
  o.offload = config.offload == Offload::kCpu && a.o.device.is_cuda();
  if (config.offload == Offload::kCpu && !o.offload) {
    a.log("fully_shard offload: cpu: this is a CPU run, shards and optimizer state already live in host memory; "
          "nothing to move");
  }
  o.per_rank = config.per_rank;
  o.placements = a.par.placements.get();
  // split by an earlier transform over one of the dims fully_shard spans (expert_parallel's experts over the
  // dim it borrows, alone or flattened with others as "dp+cp")
  o.already_split = [placements = o.placements, dims = flat_dims({shard.name})](const torch::Tensor& p) {
    const ShardSpec* spec = placements->find(p);
    return spec && spec->split_over(dims);
  };
  if (config.shard_placement == ShardPlacement::kOppositeTp) o.shard_dim = opposite_dim(a.par.placements.get());
  return o;
}

}  // namespace

bool apply(Applying& a, const FullyShardConfig& config) {
  Parallel& par = a.par;
  Group& shard = a.group({config.mesh_dim.back()});  // "dp+cp": the dims flattened
  Group& spanned = a.group(config.mesh_dim);          // per-rank parameters differ over every dim it spans
  const FullyShardOptions o = rank_options(a, config, shard);
  if (!o.per_rank.empty()) par.per_rank = apply_per_rank(par.roots, spanned, o.per_rank, *par.placements);
  par.take_over_cp(spanned);
  par.fsdp = apply_fully_shard(par.roots, shard, o);
  a.log("applied fully_shard " + over(&spanned) + ": " + std::to_string(par.fsdp->num_units()) + " units");
  return true;
}

void trace(Tracing&, const FullyShardConfig&) {}

}  // namespace composer::parallel

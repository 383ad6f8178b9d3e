#include "runner/estimate.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "models/module.h"
#include "runner/data.h"
#include "runner/errors.h"
#include "runner/memory.h"
#include "runner/optim.h"
#include "runner/trainer.h"

namespace composer {

void ensure_meta_kernels();  // meta_kernels.cpp

namespace {

int64_t bytes_of(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n * static_cast<int64_t>(c10::elementSize(dtype));
}

int64_t optimizer_copies(const OptimizerConfig& o) {
  if (o.name == OptimizerKind::kSgd) return o.momentum != 0 ? 1 : 0;
  return 2;  // exp_avg, exp_avg_sq
}

// A batch of `n` samples as the dataset makes them, on the meta device.
Batch meta_batch(const DataPlan& p, int64_t n) {
  auto meta = torch::TensorOptions().device(torch::kMeta);
  Batch b;
  if (p.targets == TargetKind::kNextTokens || p.inputs == InputKind::kTokens) {
    b.inputs = torch::empty({n, p.seq_len}, meta.dtype(torch::kLong));
  } else {
    b.inputs = torch::empty({n, p.input.features}, meta.dtype(p.dtype));
  }
  std::vector<int64_t> out{n};
  out.insert(out.end(), p.output_shape.begin(), p.output_shape.end());
  switch (p.targets) {
    case TargetKind::kNextTokens: b.targets = torch::empty({n, p.seq_len}, meta.dtype(torch::kLong)); break;
    case TargetKind::kNormal:
    case TargetKind::kUniform: b.targets = torch::empty(out, meta.dtype(torch::kFloat)); break;
    case TargetKind::kTokens:
      out.pop_back();
      b.targets = torch::empty(out, meta.dtype(torch::kLong));
      break;
    default: break;
  }
  return b;
}

// The bytes one microbatch of `n` samples adds over the parameters while its
// forward and backward run on one device: activations, the batch, and the
// gradients as they form.
int64_t microbatch_bytes(const ExperimentConfig& c, int64_t n) {
  ensure_meta_kernels();
  nn::ShapeOnly shapes;
  memory::MetaCount count;
  models::ModelPtr model = build_model(c);
  model->to(scalar_type_of(c.train.dtype));
  model->train();
  const DataPlan data = plan_data(c, *model);
  const int64_t before = count.live();
  count.reset_peak();
  {
    Batch b = meta_batch(data, n);
    auto loss = compute_loss(c.train.loss, (*model)(b.inputs), b.targets, n, c.train.global_batch);
    loss.backward();
  }
  return count.peak() - before;
}

// The dataset's tensors held in memory: a data file's inputs and targets.
int64_t data_bytes(const ExperimentConfig& c) {
  if (c.data.source != DataSource::kFile) return 0;  // synthetic batches are made per step; token files are mapped
  FILE* f = std::fopen(c.data.path.c_str(), "rb");
  if (!f) return 0;
  std::fseek(f, 0, SEEK_END);
  const int64_t size = std::ftell(f);
  std::fclose(f);
  return size;  // the header is a few hundred bytes of it
}

}  // namespace

int64_t MemoryEstimate::peak() const {
  return params + optimizer + buffers + data + std::max(activations, grads);
}

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.3g TiB", b / (1024.0 * 1024 * 1024 * 1024));
  else if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024));
  else std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  return buf;
}

std::string MemoryEstimate::str() const {
  return "params " + format_bytes(params) + ", grads " + format_bytes(grads) + ", optimizer " +
         format_bytes(optimizer) + ", fully_shard buffers " + format_bytes(buffers) + ", activations " +
         format_bytes(activations) + ", data " + format_bytes(data) + "; peak " + format_bytes(peak());
}

std::vector<MemoryEstimate> estimate_memory(const ExperimentConfig& c, const Plan& plan) {
  std::vector<MemoryEstimate> out;
  const int64_t copies = optimizer_copies(c.train.optimizer);
  const int64_t data = data_bytes(c);
  const int64_t mb = plan.pp_microbatches ? plan.local_batch / plan.pp_microbatches : plan.local_microbatch;
  const int64_t one_microbatch = microbatch_bytes(c, mb);
  const TransformConfig* fsdp = nullptr;
  for (const auto& t : plan.transforms) {
    if (t.kind == TransformKind::kFullyShard) fsdp = &t;
  }
  // Every rank of a job of up to 64; beyond, rank 0 and the first rank of
  // each pipeline stage (data and tensor parallel peers hold the same shapes).
  std::vector<int> ranks;
  for (int r = 0; r < plan.world_size; ++r) ranks.push_back(r);
  if (plan.world_size > 64) ranks.resize(std::min<size_t>(ranks.size(), 1));
  for (const auto& t : plan.transforms) {
    if (t.kind != TransformKind::kPipeline || plan.world_size <= 64) continue;
    const auto& names = c.mesh.names;
    const size_t d = std::find(names.begin(), names.end(), t.mesh_dim.front()) - names.begin();
    int64_t stride = 1;
    for (size_t i = d + 1; i < names.size(); ++i) stride *= c.mesh.shape[i];
    for (int64_t s = 1; s < c.mesh.shape[d]; ++s) ranks.push_back(static_cast<int>(s * stride));
  }
  for (int r : ranks) {
    MemoryEstimate e;
    e.rank = r;
    e.data = data;
    int64_t largest_unit = 0, units_total = 0;
    with_planned_model(c, plan, r, [&](models::Model& model, const parallel::Placements& placements) {
      std::map<std::string, int64_t> unit_bytes;  // fully_shard: unsharded bytes per unit
      for (auto& [name, p] : nn::unique_named_parameters(model)) {
        const parallel::ShardSpec* spec = placements.find(p);
        const c10::ScalarType dtype = p.scalar_type();
        if (spec && !spec->held()) continue;
        const int64_t local = spec ? bytes_of(spec->local_shape(), dtype) : bytes_of(p.sizes().vec(), dtype);
        e.params += local;
        if (fsdp && spec) {
          // The piece before fully_shard split it, in the compute dtype.
          size_t levels = 0;
          for (const auto& d : spec->dims) {
            if (std::find(fsdp->mesh_dim.begin(), fsdp->mesh_dim.end(), d.name) != fsdp->mesh_dim.end()) break;
            ++levels;
          }
          const c10::ScalarType compute = fsdp->param_dtype ? scalar_type_of(*fsdp->param_dtype) : dtype;
          std::string unit;  // the longest unit pattern's match is the parameter's unit; approximated by FQN prefix
          for (const auto& u : fsdp->units) {
            const std::string prefix = u.substr(0, u.find('*'));
            if (!prefix.empty() && name.rfind(prefix, 0) == 0) {
              const size_t end = name.find('.', prefix.size());
              unit = name.substr(0, end);
            }
          }
          unit_bytes[unit] += bytes_of(spec->box(levels).size, compute);
        }
      }
      for (const auto& [u, b] : unit_bytes) {
        largest_unit = std::max(largest_unit, b);
        units_total += b;
      }
    });
    e.grads = e.params;
    e.optimizer = copies * e.params;
    if (fsdp) e.buffers = fsdp->reshard_after_forward ? std::min(units_total, (fsdp->prefetch ? 2 : 1) * largest_unit) : units_total;
    e.activations = one_microbatch;
    out.push_back(e);
  }
  return out;
}

int64_t memory_per_rank(const ExperimentConfig& c, int64_t local_ranks) {
  if (c.mesh.memory_per_rank_mb > 0) return static_cast<int64_t>(c.mesh.memory_per_rank_mb * 1024 * 1024);
  const int64_t host = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  return host / std::max<int64_t>(1, local_ranks);
}

void check_fit(const ExperimentConfig& c, const std::vector<MemoryEstimate>& estimates, int64_t local_ranks) {
  const int64_t limit = memory_per_rank(c, local_ranks);
  for (const auto& e : estimates) {
    if (e.peak() <= limit) continue;
    const char* help = "a smaller model or batch";
    const int64_t state = e.params + e.grads + e.optimizer;
    if (state >= e.activations) help = "fully_shard (shards parameters, gradients and optimizer state over dp) or "
                                       "tensor_parallel over more ranks";
    else help = "more microbatches (train.microbatches), activation_checkpointing, or a smaller global_batch";
    throw PlanError(c.model.ref, "rank " + std::to_string(e.rank) + " needs about " + format_bytes(e.peak()) +
                                    " but may use " + format_bytes(limit) + " (" + e.str() + "); try " + help +
                                    ", or set mesh.memory_per_rank_mb if more is available");
  }
}

}  // namespace composer

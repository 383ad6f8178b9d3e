#include "runner/estimate/estimate.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

#include "models/module.h"
#include "parallelisms/comm/cuda_runtime.h"
#include "runner/train/data.h"
#include "runner/base/errors.h"
#include "runner/base/memory.h"
#include "runner/train/optim.h"
#include "runner/estimate/dry_run.h"
#include "runner/train/build.h"

namespace composer {

namespace {

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

int64_t MemoryEstimate::peak() const { return step_peak + data; }

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.3g TiB", b / (1024.0 * 1024 * 1024 * 1024));
  else if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  return buf;
}

std::string MemoryEstimate::str() const {
  return "params " + format_bytes(params) + ", grads " + format_bytes(grads) + ", optimizer " +
         format_bytes(optimizer) + ", comm buffers " + format_bytes(buffers) + ", activations " +
         format_bytes(activations) + ", data " + format_bytes(data) + "; peak " + format_bytes(peak()) + " (" +
         std::to_string(peak()) + " B)";
}

std::string MemoryEstimate::comm_str() const {
  std::string out;
  for (const auto& [group, kinds] : comm) {
    for (const auto& [kind, bytes] : kinds) {
      out += (out.empty() ? "" : ", ") + group + " " + kind + " " + std::to_string(bytes) + " B";
    }
  }
  return out.empty() ? "none" : out;
}

std::vector<MemoryEstimate> estimate_memory(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks) {
  ensure_meta_kernels();
  std::vector<MemoryEstimate> out;
  const int64_t data = data_bytes(c);
  // Every rank of a job of up to 64; beyond, rank 0 and the first rank of
  // each pipeline stage (data and tensor parallel peers hold the same shapes).
  std::vector<int> ranks;
  for (int r = 0; r < plan.world_size; ++r) ranks.push_back(r);
  if (plan.world_size > 64) ranks = stage_first_ranks(c, plan);
  for (int r : ranks) {
    // Two steps: the second starts with the first's gradients and optimizer state.
    // On the CPU, a matmul's own scratch space depends on the rank's threads.
    std::optional<memory::CpuMatmulWorkspaces> workspaces;
    if (c.mesh.device == DeviceKind::kCpu) workspaces.emplace(rank_threads(c.train, local_ranks ? local_ranks : plan.world_size));
    const DryRun run = dry_run(c, plan, r, 2, meta_batch);
    MemoryEstimate e;
    e.rank = r;
    e.params = run.terms.params;
    e.grads = run.terms.grads;
    e.optimizer = run.terms.optimizer;
    e.buffers = run.terms.buffers;
    e.step_peak = *std::max_element(run.step_peaks.begin(), run.step_peaks.end());
    e.activations = std::max<int64_t>(0, e.step_peak - e.params - e.optimizer - e.buffers);
    e.data = data;
    e.comm = run.comm;
    out.push_back(e);
  }
  return out;
}

int64_t memory_per_rank(const ExperimentConfig& c, int64_t local_ranks) {
  if (c.mesh.memory_per_rank_mb > 0) return static_cast<int64_t>(c.mesh.memory_per_rank_mb * 1024 * 1024);
  if (c.mesh.device == DeviceKind::kCuda) {  // each local rank has a GPU of its own (check_devices)
    std::string why;
    if (parallel::CudaRuntime* cuda = parallel::cuda_runtime(why)) return cuda->total_memory(0);
  }
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

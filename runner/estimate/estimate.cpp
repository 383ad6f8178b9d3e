#include "runner/estimate/estimate.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <cstdio>
#include <map>
#include <optional>
#include <variant>

#include "models/module.h"
#include "parallelisms/comm/cuda_runtime.h"
#include "parallelisms/comm/mesh.h"
#include "runner/plan/plan_mesh.h"
#include "runner/train/data.h"
#include "runner/base/errors.h"
#include "runner/base/memory.h"
#include "runner/train/optim.h"
#include "runner/estimate/dry_run.h"
#include "runner/train/build.h"

namespace composer {

// A batch of `n` samples as the dataset makes them, on the meta device.
Batch meta_batch(const DataPlan& p, int64_t n) {
  auto meta = torch::TensorOptions().device(torch::kMeta);
  Batch b;
  if (p.targets == TargetKind::kNextTokens || p.inputs == InputKind::kTokens) {
    b.inputs = torch::empty({n, p.seq_len}, meta.dtype(torch::kLong));
    if (p.documents) b.doc_start = torch::empty({n, p.seq_len}, meta.dtype(torch::kLong));
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

namespace {

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

int64_t MemoryEstimate::peak() const { return step_peak + data + checkpoint_copy; }

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
         format_bytes(activations) + ", data " + format_bytes(data) +
         (checkpoint_copy ? ", async checkpoint copy " + format_bytes(checkpoint_copy) : std::string()) + "; peak " + format_bytes(peak()) + " (" +
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

namespace {

// The mesh dims that only replicate and fully_shard span, each with the
// number of consecutive coordinates that are alike there: ranks that differ
// only within such a run execute the same program on batches of the same
// shapes (their own samples), in groups of the same sizes, so where they also
// hold pieces of the same shapes of every parameter, their dry runs are the
// same. A run is the whole dim, or fully_shard's reshard_after_forward N
// (each rank's N-rank subgroup is a group of its own). 0: not such a dim.
// A dim only tensor_parallel spans is one run too: its ranks run the same
// program on the same batch, each on its piece of every split weight (and
// of the sequence and the vocabulary under sequence and loss parallelism),
// so where their pieces have the same shapes their dry runs are the same.
// (Below, likewise for load-balanced context parallelism.)
std::vector<int64_t> data_parallel_runs(const ExperimentConfig& c) {
  const auto& names = c.mesh.names;
  std::vector<int64_t> runs(c.mesh.shape.begin(), c.mesh.shape.end());
  std::vector<bool> splits_batch(names.size(), false);
  auto index = [&](const std::string& d) { return std::find(names.begin(), names.end(), d) - names.begin(); };
  std::vector<bool> tensor_parallel(names.size(), false), sequence_parallel(names.size(), false);
  for (const auto& t : c.parallelize) {
    const auto* fsdp = std::get_if<FullyShardConfig>(&t.options);
    const bool dp = data_parallel(t);  // expert_parallel's ranks too: the same shapes under uniform routing
    // So is a dim only load-balanced context_parallel spans, without document masks: every rank holds two
    // chunks of each sequence, and at each step of the ring (or the gather) meets a block of the same shapes
    // with the same count of full, causal and skipped chunk pairs (i and 2cp-1-i against j and 2cp-1-j).
    // A data-parallel transform may span that dim too (its gradients are reduced over the cp ranks).
    const auto* cp = std::get_if<ContextParallelConfig>(&t.options);
    const bool tp = std::holds_alternative<TensorParallelConfig>(t.options);
    const bool alike_cp = cp && cp->load_balance && !c.data.documents.active();
    for (const auto& d : t.mesh_dim()) {
      const size_t i = static_cast<size_t>(index(d));
      if (i >= names.size()) continue;
      if (!dp && !tp && !alike_cp) runs[i] = 0;
      splits_batch[i] = splits_batch[i] || dp;
      tensor_parallel[i] = tensor_parallel[i] || tp;
      sequence_parallel[i] = sequence_parallel[i] || alike_cp;
    }
    if (fsdp && fsdp->reshard_after_forward.size > 1) {  // subgroups of N consecutive ranks of the shard dim
      const auto shard = flat_dims({fsdp->mesh_dim.back()});
      for (const auto& d : shard) {
        const size_t i = static_cast<size_t>(index(d));
        if (i < names.size()) runs[i] = shard.size() == 1 ? std::min(runs[i], fsdp->reshard_after_forward.size) : 0;
      }
    }
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (!splits_batch[i] && !tensor_parallel[i] && !sequence_parallel[i]) runs[i] = 0;
    if (sequence_parallel[i] && tensor_parallel[i]) runs[i] = 0;
    if (splits_batch[i] && tensor_parallel[i]) runs[i] = 0;  // one dim for both: not a case of either
    // Muon's owners differ from rank to rank (what each gathers, holds whole and sends back): no
    // two ranks run alike, so each gets a dry run of its own.
    if (c.train.optimizer.name == OptimizerKind::kMuon) runs[i] = 0;
  }
  return runs;
}

// The sizes of the pieces of every parameter that the rank at `coords` holds,
// from another rank's placements (the specs name the dims, "a+b" flattened).
std::vector<std::vector<int64_t>> pieces_at(const std::vector<parallel::ShardSpec>& specs, const ExperimentConfig& c,
                                            const std::vector<int64_t>& coords) {
  auto index_on = [&](const std::string& dim) {
    int64_t index = 0;
    for (const auto& d : flat_dims({dim})) {
      const size_t i = std::find(c.mesh.names.begin(), c.mesh.names.end(), d) - c.mesh.names.begin();
      index = index * c.mesh.shape.at(i) + coords.at(i);
    }
    return static_cast<int>(index);
  };
  std::vector<std::vector<int64_t>> out;
  for (const auto& s : specs) {
    std::vector<int> ranks;
    for (const auto& d : s.dims) ranks.push_back(index_on(d.name));
    out.push_back(s.box_at(ranks).size);
  }
  return out;
}

// Rank `r`'s figures from its dry run; `data`: the data set's bytes.
MemoryEstimate estimate_of(const DryRun& run, const ExperimentConfig& c, int r, int64_t data) {
  MemoryEstimate e;
  e.rank = r;
  e.params = run.terms.params;
  e.grads = run.terms.grads;
  e.optimizer = run.terms.optimizer;
  e.buffers = run.terms.buffers;
  e.step_peak = *std::max_element(run.step_peaks.begin(), run.step_peaks.end());
  e.activations = std::max<int64_t>(0, e.step_peak - e.params - e.optimizer - e.buffers);
  // The data set's tensors, and the next step's share the loader reads ahead (Prefetcher).
  e.data = data + run.batch_bytes;
  // checkpoint.async: the host copy of the pieces a save writes lives into
  // the next steps: at most every parameter and optimizer state this rank
  // holds (a piece replicated over ranks is written, and copied, by one).
  if (c.checkpoint.enabled && c.checkpoint.async_save) e.checkpoint_copy = e.params + e.optimizer;
  e.comm = run.comm;
  return e;
}

// estimate_memory's figures for every rank but those `skip` names.
std::vector<MemoryEstimate> estimate_ranks(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks,
                                           const std::function<bool(int)>& skip) {
  ensure_meta_kernels();
  std::vector<MemoryEstimate> out;
  const int64_t data = data_bytes(c);
  // One dry run per class of ranks that provably run the same: the same
  // coordinates on every dim but within a data-parallel run
  // (data_parallel_runs), and pieces of the same shapes of every parameter.
  // Each rank of a class gets its figures.
  const std::vector<int64_t> runs = data_parallel_runs(c);
  struct Position {  // the ranks of one position: the first dry run's placements, and a class per piece shapes
    std::vector<parallel::ShardSpec> specs;
    std::vector<std::pair<std::vector<std::vector<int64_t>>, MemoryEstimate>> classes;
  };
  std::map<std::vector<int64_t>, Position> positions;  // by the coordinates, runs collapsed
  for (int r = 0; r < plan.world_size; ++r) {
    if (skip && skip(r)) continue;
    const std::vector<int64_t> coords = parallel::coords_of(r, c.mesh.shape);
    std::vector<int64_t> key = coords;
    for (size_t i = 0; i < key.size(); ++i) {
      if (runs[i]) key[i] /= runs[i];
    }
    Position& position = positions[key];
    std::vector<std::vector<int64_t>> pieces;
    if (!position.classes.empty()) {
      pieces = pieces_at(position.specs, c, coords);
      auto same = std::find_if(position.classes.begin(), position.classes.end(),
                               [&](const auto& k) { return k.first == pieces; });
      if (same != position.classes.end()) {
        out.push_back(same->second);
        out.back().rank = r;
        continue;
      }
    }
    // Two steps: the second starts with the first's gradients and optimizer state.
    // On the CPU, a matmul's own scratch space depends on the rank's threads.
    std::optional<memory::CpuMatmulWorkspaces> workspaces;
    if (c.mesh.device == DeviceKind::kCpu) workspaces.emplace(rank_threads(c.train, local_ranks ? local_ranks : plan.world_size));
    DryRun run = dry_run(c, plan, r, 2, meta_batch);  // not const: its specs move into the position
    const MemoryEstimate e = estimate_of(run, c, r, data);
    out.push_back(e);
    if (position.classes.empty()) {
      position.specs = std::move(run.specs);
      pieces = pieces_at(position.specs, c, coords);
    }
    position.classes.emplace_back(std::move(pieces), e);
  }
  return out;
}

// The parameter shapes of each pipeline stage's pieces, in order (the model built shape-only).
std::vector<std::vector<std::vector<int64_t>>> stage_shapes(const ExperimentConfig& c, const parallel::PipelineConfig& p,
                                                             int64_t stages) {
  models::ModelPtr model;
  {
    nn::ShapeOnly shapes;
    model = build_model(c);
  }
  const auto pieces = model->pipeline_pieces();
  std::vector<std::pair<size_t, size_t>> ranges;
  if (parallel::split_stages(pieces, static_cast<int>(stages), p.split_points, p.layers_per_stage, ranges)) return {};
  std::map<std::string, nn::Module*> modules;
  for (const auto& [name, m] : nn::named_modules(*model)) modules[name] = m;
  std::vector<std::vector<std::vector<int64_t>>> out;
  for (const auto& [begin, end] : ranges) {
    std::vector<std::vector<int64_t>> shapes;
    for (size_t i = begin; i < end; ++i) {
      for (const auto& name : pieces[i].modules) {
        if (!modules.count(name)) return {};
        for (const auto& [n, t] : nn::unique_named_parameters(*modules[name])) shapes.push_back(t.sizes().vec());
      }
    }
    out.push_back(std::move(shapes));
  }
  return out;
}

// Whether the transforms and training treat every layer alike: no train.freeze, no Muon (each rank's
// owners differ), checkpointing every unit, and checkpointing's and fully_shard's units given as
// patterns (a '*'), not as particular layers.
bool alike_layers(const ExperimentConfig& c) {
  if (!c.train.freeze.empty() || c.train.optimizer.name == OptimizerKind::kMuon) return false;
  auto patterns = [](const std::vector<std::string>& units) {
    return std::all_of(units.begin(), units.end(), [](const std::string& u) {
      return u.find('*') != std::string::npos || u.find_first_of("0123456789") == std::string::npos;
    });
  };
  for (const auto& t : c.parallelize) {
    if (const auto* ac = t.get<ActivationCheckpointingConfig>(); ac && (ac->every > 1 || !patterns(ac->units))) return false;
    if (const auto* fs = t.get<FullyShardConfig>(); fs && !patterns(fs->units)) return false;
  }
  return true;
}

}  // namespace

std::vector<MemoryEstimate> estimate_memory(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks) {
  return estimate_ranks(c, plan, local_ranks, {});
}

namespace {

int64_t largest_peak(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks);

}  // namespace

int64_t estimate_peak(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks, int64_t stop_above) {
  if (stop_above <= 0) return largest_peak(c, plan, local_ranks);
  memory::MetaLimit limit(stop_above);
  try {
    return largest_peak(c, plan, local_ranks);
  } catch (const std::exception&) {  // the limit's own, or what an op or the pipeline wrapped it in
    if (!memory::MetaLimit::crossed()) throw;
  }
  return stop_above + 1;
}

namespace {

int64_t largest_peak(const ExperimentConfig& c, const Plan& plan, int64_t local_ranks) {
  auto largest = [](const std::vector<MemoryEstimate>& all) {
    int64_t peak = 0;
    for (const auto& e : all) peak = std::max(peak, e.peak());
    return peak;
  };
  const parallel::PipelineConfig* p = plan.find<parallel::PipelineConfig>();
  using parallel::ScheduleKind;
  if (!p || (p->schedule != ScheduleKind::k1f1b && p->schedule != ScheduleKind::kInterleaved1f1b)) {
    return largest(estimate_memory(c, plan, local_ranks));
  }
  const auto& names = c.mesh.names;
  const size_t pp_dim = std::find(names.begin(), names.end(), p->mesh_dim.at(0)) - names.begin();
  const int64_t pp = c.mesh.shape.at(pp_dim), v = p->virtual_stages;
  // 1F1B and interleaved 1F1B place stage s on rank s mod pp, and warm up with fewer microbatches on
  // each rank than on the one before it (1F1B: pp - 1 - rank; interleaved: 2 (pp - 1 - rank) + (v - 1) pp
  // chunks). So a rank between the second and the last whose stages have the same parameters as the
  // previous rank's holds less in flight, and peaks no higher: it needs no dry run. Only where the
  // transforms treat every layer alike (alike_layers).
  std::function<bool(int)> skip;
  if (pp > 3 && alike_layers(c)) {
    const auto stages = stage_shapes(c, *p, pp * v);
    if (static_cast<int64_t>(stages.size()) == pp * v) {
      auto same_as_previous = [&stages, pp, v](int64_t rank) {
        for (int64_t k = 0; k < v; ++k) {
          if (stages[k * pp + rank] != stages[k * pp + rank - 1]) return false;
        }
        return true;
      };
      std::vector<bool> skipped(pp, false);
      for (int64_t rank = 2; rank <= pp - 2; ++rank) skipped[rank] = same_as_previous(rank);
      skip = [skipped, pp_dim, &c](int r) { return skipped[parallel::coords_of(r, c.mesh.shape).at(pp_dim)]; };
    }
  }
  return largest(estimate_ranks(c, plan, local_ranks, skip));
}

}  // namespace

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

std::map<int, parallel::P2PLog> p2p_logs(const ExperimentConfig& c, const Plan& plan, const std::vector<int>& ranks) {
  ensure_meta_kernels();
  std::map<int, parallel::P2PLog> out;
  for (int r : ranks) {
    parallel::P2PRecorder recorder;
    dry_run(c, plan, r, 1, meta_batch);
    out[r] = recorder.log();
  }
  return out;
}

}  // namespace composer

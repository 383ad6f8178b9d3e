// `composer suggest --from-run DIR`: a finished run's measured step against
// the cost model's price of its own plan, term by term, and the machine's
// rates refit from it.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "runner/suggest/search.h"
#include "runner/suggest/suggest.h"

namespace composer {
using namespace suggest_detail;

namespace suggest_detail {
namespace {

int64_t mesh_dim_size(const ExperimentConfig& c, const std::string& name) {
  for (size_t i = 0; i < c.mesh.names.size(); ++i) {
    if (c.mesh.names[i] == name) return c.mesh.shape[i];
  }
  return 1;
}

int64_t mesh_span_size(const ExperimentConfig& c, const std::vector<std::string>& dims, const std::string& leave_out) {
  int64_t n = 1;
  for (const auto& d : dims) n *= d == leave_out ? 1 : mesh_dim_size(c, d);
  return n;
}

// The data-parallel transform's part of the shape (the dims it spans, cp's left out).
void data_parallel_of(Shape& s, const TransformConfig& t, const ExperimentConfig& c, const std::string& cp_dim) {
  const auto dims = t.mesh_dim();
  if (t.get<ReplicateConfig>()) {
    s.dp_mode = DpMode::kReplicate;
    s.dp = mesh_span_size(c, dims, cp_dim);
    return;
  }
  const auto* f = t.get<FullyShardConfig>();
  s.keep = f->reshard_after_forward.size == 1;
  if (f->param_dtype && *f->param_dtype == DType::kBFloat16) s.precision = Precision::kBf16;
  if (t.mesh_dim_entries().size() == 2) {
    s.dp_mode = DpMode::kHsdp;
    s.dp = mesh_span_size(c, dims, cp_dim);
    s.shard = mesh_dim_size(c, t.mesh_dim_entries()[1]);
  } else {
    s.dp_mode = DpMode::kFullyShard;
    s.dp = mesh_span_size(c, dims, cp_dim);
  }
}

}  // namespace

Shape shape_of(const ExperimentConfig& c, const Plan& plan) {
  Shape s;
  std::string cp_dim, ep_dim;
  std::vector<std::string> dp_dims;
  for (const auto& t : c.parallelize) {
    const auto dims = t.mesh_dim();
    const int64_t size = dims.empty() ? 1 : mesh_span_size(c, dims, "");
    if (const auto* p = t.get<PipelineConfig>()) {
      s.pp = size, s.schedule = p->schedule, s.virtual_stages = p->virtual_stages;
    } else if (const auto* tp = t.get<TensorParallelConfig>()) {
      s.tp = size, s.tp_style = tp->sequence_parallel ? (tp->loss_parallel ? 0 : 1) : 2;
    } else if (const auto* cp = t.get<ContextParallelConfig>()) {
      s.cp = size, s.rotate = static_cast<int>(cp->rotate), cp_dim = dims.at(0);
    } else if (t.get<ExpertParallelConfig>()) {
      s.ep = size, ep_dim = dims.at(0);
    } else if (const auto* ac = t.get<ActivationCheckpointingConfig>()) {
      s.ac = ac->mode == parallel::CheckpointMode::kOp ? Ac::kOp : Ac::kFull, s.ac_every = ac->every;
    } else if (t.get<ReplicateConfig>() || t.get<FullyShardConfig>()) {
      data_parallel_of(s, t, c, cp_dim);
      dp_dims = dims;
    }
  }
  s.ep_borrows_dp = !ep_dim.empty() && std::find(dp_dims.begin(), dp_dims.end(), ep_dim) != dp_dims.end();
  if (dp_dims.empty()) s.dp = 1;
  s.microbatches = plan.microbatches;
  if (c.train.fp8) s.precision = Precision::kFp8Tensorwise;
  int64_t world = 1;
  for (int64_t d : c.mesh.shape) world *= d;
  if (s.tp * s.cp * s.pp * s.batch_split() != world) {
    throw UserError("composer suggest --from-run: the plan's mesh (" + std::to_string(world) +
                    " ranks) is not one the search writes (tp x cp x pp x dp x ep = " +
                    std::to_string(s.tp * s.cp * s.pp * s.batch_split()) + "); it prices plans it could suggest");
  }
  return s;
}

}  // namespace suggest_detail

namespace {

struct Measured {
  double step_ms = 0, comm_ms = 0, compute_ms = 0;
  double calls = -1, sent_bytes = -1;  // the main rank's collectives and their ring bytes a step; -1: not recorded
  int64_t steps = 0;
};

double run_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The run's steps after the first two (warm-up), each rank's communication wait averaged.
Measured measured_of(const std::string& dir) {
  const std::string path = dir + "/metrics.jsonl";
  std::ifstream f(path);
  if (!f) throw UserError("--from-run " + dir + ": no metrics.jsonl there; give a finished run's folder (--out of composer run)");
  std::vector<double> step, comm, calls, sent;
  std::string line;
  for (int64_t k = 0; std::getline(f, line); ++k) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step_ms") || k < 2) continue;
    step.push_back(j["step_ms"].get<double>());
    double wait = j.value("comm_wait_ms", 0.0);
    if (j.contains("rank_comm_wait_ms") && !j["rank_comm_wait_ms"].empty()) {
      wait = 0;
      for (const auto& x : j["rank_comm_wait_ms"]) wait += x.get<double>();
      wait /= static_cast<double>(j["rank_comm_wait_ms"].size());
    }
    comm.push_back(wait);
    if (j.contains("comm_calls") && j.contains("comm_ring_bytes")) {
      calls.push_back(j["comm_calls"].get<double>());
      sent.push_back(j["comm_ring_bytes"].get<double>());
    }
  }
  if (step.empty()) throw UserError("--from-run " + dir + ": metrics.jsonl has no steps past the first two; train 3 or more");
  Measured m;
  m.steps = static_cast<int64_t>(step.size());
  m.step_ms = run_median(step);
  m.comm_ms = std::min(run_median(comm), m.step_ms);
  m.compute_ms = m.step_ms - m.comm_ms;
  if (calls.size() == step.size()) m.calls = run_median(calls), m.sent_bytes = run_median(sent);
  return m;
}

void check_same_config(const std::string& dir, const ExperimentConfig& c) {
  std::ifstream f(dir + "/config.resolved.json");
  if (!f) return;
  const auto j = nlohmann::json::parse(f, nullptr, false);
  if (!j.is_discarded() && j.contains("config_hash") && j["config_hash"].get<std::string>() != config_hash(c)) {
    throw UserError("--from-run " + dir + ": that run was trained from another config (its config_hash " +
                    j["config_hash"].get<std::string>() + ", this one's " + config_hash(c) +
                    "); give --config the file (and --set) the run started with");
  }
}

std::string fixed(double x, int digits) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(digits);
  o << x;
  return o.str();
}

std::string fixed1(double x) { return fixed(x, 1); }

}  // namespace

std::vector<std::string> compare_with_run(const std::string& run_dir, const ExperimentConfig& c, const Plan& plan,
                                          World& w) {
  if (!std::filesystem::is_directory(run_dir)) throw UserError("--from-run " + run_dir + ": not a folder");
  check_same_config(run_dir, c);
  const Measured m = measured_of(run_dir);
  const Shape s = shape_of(c, plan);
  const ModelFacts f = facts_of(c);
  const StepTerms t = price(s, f, c, w);
  const double compute = t.compute_s() * 1e3, comm = t.comm_s() * 1e3;
  std::vector<std::string> out;
  out.push_back("run " + run_dir + " (" + s.name() + ", median of " + std::to_string(m.steps) + " steps after the first two)");
  out.push_back("  step: measured " + fixed1(m.step_ms) + " ms, predicted " + fixed1(compute + comm) + " ms (" +
                fixed1(100 * ((compute + comm) / m.step_ms - 1)) + "%)");
  out.push_back("  compute: measured " + fixed1(m.compute_ms) + " ms, predicted " + fixed1(compute) + " ms");
  out.push_back("  communication waited for: measured " + fixed1(m.comm_ms) + " ms, predicted " + fixed1(comm) + " ms");
  for (const auto& [name, x] : t.named_ms()) {
    if (x >= 0.05) out.push_back("    predicted " + name + ": " + fixed1(x) + " ms");
  }
  if (m.calls >= 0) {  // what the model counts against what the run sent (its main rank's)
    out.push_back("  collectives a step: measured " + fixed1(m.calls) + " calls sending " +
                  fixed(m.sent_bytes / 1e6, 4) + " MB, priced " + fixed1(t.calls) + " calls sending " +
                  fixed(t.sent_bytes / 1e6, 4) + " MB");
  }
  const double compute_miss = compute > 0 ? m.compute_ms / compute : 1, comm_miss = comm > 0 ? m.comm_ms / comm : 1;
  out.push_back(std::string("  the larger miss: ") +
                (std::abs(std::log(compute_miss)) >= std::abs(std::log(comm_miss))
                     ? "compute, measured " + fixed1(compute_miss * 100) + "% of the prediction"
                     : "communication, measured " + fixed1(comm_miss * 100) + "% of the prediction"));
  // Refit: the run's unfitted prediction and its measurement join the machine's runs.
  MachineRates& r = w.rates;
  const double raw_compute =
      (t.matmul_s + t.elementwise_s + t.kernels_s + t.optimizer_s + t.comm_core_s) + t.bubble_s / t.compute_fit;
  r.runs.push_back({s.name(), raw_compute, t.comm_latency_s, t.raw_comm_s() - t.comm_latency_s, m.compute_ms / 1e3,
                    m.comm_ms / 1e3});
  r.refit();
  std::ostringstream fit;
  fit.precision(3);
  fit << "  refit from " << r.runs_fitted << " run(s): compute x" << r.compute_fit << ", communication latency x"
      << r.latency_fit << ", bytes x" << r.bandwidth_fit;
  if (!r.key.empty()) {
    save_rates(r);
    fit << ", saved in " << machine_cache_path();
  } else {
    fit << " (rates given with --rates: not saved)";
  }
  out.push_back(fit.str());
  return out;
}

}  // namespace composer

#include "runner/estimate/dry_run.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "models/layers.h"
#include "runner/base/memory.h"
#include "runner/train/build.h"
#include "runner/train/optim.h"

namespace composer {
namespace {

// A rank of the job on a mesh without process groups (a plan's view of it),
// not the main rank: it logs nothing.
RankContext planning_rank(const ExperimentConfig& c, const Plan& plan, int r) {
  RankContext ctx;
  ctx.rank = r;
  ctx.world_size = static_cast<int>(plan.world_size);
  parallel::MeshOptions o;
  o.connect = false;
  o.backend = name_of(c.mesh.backend);  // the order a pipeline issues its sends and receives in
  if (!plan.transforms.empty()) {
    ctx.mesh = std::make_unique<parallel::DeviceMesh>(c.mesh.names, c.mesh.shape, r, c10::intrusive_ptr<c10d::Store>(),
                                                      o, plan.flat_groups);
  }
  ctx.rank = -1;
  return ctx;
}

// Every parameter of the first rank of each pipeline stage (together they
// hold every parameter), with its placement there (null: none), the model
// built shape-only and the plan applied on a mesh without process groups:
// fn(first stage, name, parameter, spec).
void visit_stage_parameters(
    const ExperimentConfig& c, const Plan& plan,
    const std::function<void(bool, const std::string&, const torch::Tensor&, const parallel::ShardSpec*)>& fn) {
  const std::vector<int> ranks = stage_first_ranks(c, plan);
  for (int r : ranks) {
    RankContext ctx = planning_rank(c, plan, r);
    nn::ShapeOnly shapes;  // names and placements only
    models::ModelPtr model = build_model(c);
    model->to(scalar_type_of(c.train.dtype));
    parallel::Parallel par = apply_plan(*model, c, plan, ctx, nullptr);
    for (auto& [name, p] : nn::unique_named_parameters(*model)) fn(r == ranks.front(), name, p, par.placements->find(p));
  }
}

}  // namespace

std::vector<PlacementRow> describe_placements(const ExperimentConfig& c, const Plan& plan) {
  if (plan.transforms.empty()) return {};
  std::vector<std::string> names;
  std::map<std::string, PlacementRow> rows;
  visit_stage_parameters(c, plan, [&](bool first, const std::string& name, const torch::Tensor& p,
                                      const parallel::ShardSpec* spec) {
    if (first) names.push_back(name);
    if (!spec || !spec->held() || rows.count(name)) return;
    const std::string s = spec->str();  // "[16, 8] tp:S(0) ..."
    const size_t cut = s.find("] ");
    rows[name] = {name, s.substr(0, cut + 1), cut == std::string::npos ? "" : s.substr(cut + 2),
                  p.requires_grad() ? parallel::grad_plan(*spec).str() : "none (frozen)"};
  });
  std::vector<PlacementRow> out;
  for (const auto& n : names) out.push_back(rows.count(n) ? rows[n] : PlacementRow{n, "", "(no placement)", ""});
  return out;
}

MuonTraffic muon_traffic(const ExperimentConfig& c, const Plan& plan) {
  MuonTraffic out;
  if (c.train.optimizer.name != OptimizerKind::kMuon) return out;
  const MuonConfig muon = c.train.optimizer.muon_or_default();
  const int64_t in_bytes = c10::elementSize(scalar_type_of(c.train.dtype));
  const int64_t back_bytes = c10::elementSize(scalar_type_of(muon.ns_dtype));
  const int64_t world = c.mesh.world_size();
  std::set<std::string> seen;
  visit_stage_parameters(c, plan, [&](bool, const std::string& name, const torch::Tensor& p,
                                      const parallel::ShardSpec* spec) {
    if (!p.requires_grad() || (spec && !spec->held()) || !seen.insert(name).second) return;
    const auto shape = spec && !spec->global_shape.empty() ? spec->global_shape : p.sizes().vec();
    if (!muon_trains(muon, name, shape)) return;
    ++out.matrices;
    const int64_t n = c10::multiply_integers(shape);
    out.values += n;
    const auto levels = spec ? parallel::WholeMatrices::splitting_dims(*spec, muon_stack_dims(shape))
                             : std::vector<size_t>{};
    if (levels.empty()) {
      ++out.whole_here;
      return;
    }
    int64_t holders = world, pieces = 1;
    for (const auto& d : spec->dims) {
      if (!d.members.empty()) holders = holders * static_cast<int64_t>(d.members.size()) / d.size;
    }
    for (size_t i : levels) pieces *= spec->dims[i].size;
    const int64_t copies = holders / pieces;
    for (size_t i : levels) {
      const parallel::SpecDim& d = spec->dims[i];
      auto& [to, back] = out.bytes[d.name];
      to += copies * n * (d.size - 1) / d.size * in_bytes;
      back += copies * n * (d.size - 1) / d.size * back_bytes;
    }
  });
  return out;
}

DryRun dry_run(const ExperimentConfig& c, const Plan& plan, int r, int64_t steps, const MetaBatch& meta_batch) {
  memory::MetaCount count;
  nn::ShapeOnly shapes;
  nn::GpuKernelShapes fused(c.mesh.device == DeviceKind::kCuda);  // a GPU's attention and RMSNorm kernels
  RankContext ctx = planning_rank(c, plan, r);
  DryRun out;
  models::ModelPtr model = build_model(c);
  model->to(scalar_type_of(c.train.dtype));
  model->train();
  const DataPlan data = plan_data(c, *model);
  if (c.data.source == DataSource::kTokens) {  // token files are read a step ahead (Prefetcher)
    const Batch whole = meta_batch(data, plan.local_batch);
    for (const auto* t : {&whole.inputs, &whole.targets, &whole.doc_start}) {
      if (t->defined()) out.batch_bytes += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  const int64_t mb = plan.local_microbatch;
  parallel::Parallel par = apply_plan(*model, c, plan, ctx, [&] { return meta_batch(data, mb).inputs; });
  par.derive_grad_sync();
  par.device = torch::kMeta;
  for (auto& [name, p] : nn::unique_named_parameters(*model)) {
    const parallel::ShardSpec* spec = par.placements->find(p);
    if (!spec) continue;
    out.specs.push_back(*spec);
    for (auto& d : out.specs.back().dims) d.group = d.member_group = nullptr;
  }
  std::vector<torch::Tensor> params = par.held_params();
  params.erase(std::remove_if(params.begin(), params.end(), [](const torch::Tensor& p) { return !p.requires_grad(); }),
               params.end());  // train.freeze: a frozen parameter gets no optimizer state
  auto optimizer = make_optimizer(c.train.optimizer, params, names_in(*model, params),
                                  std::make_shared<parallel::WholeMatrices>(par.placements.get()));
  static const parallel::Delays kNoDelays({}, 0);
  StepState state{c,
                  plan,
                  *model,
                  par,
                  params,
                  *optimizer,
                  [&](int64_t, int64_t begin, int64_t end) { return meta_batch(data, end - begin); },
                  (par.dp ? par.dp->rank : 0) * plan.local_batch,
                  {},
                  static_cast<double>(plan.dp_size),
                  kNoDelays};
  const int64_t before = count.live(), buffers_before = par.buffer_bytes();
  for (int64_t step = 1; step <= steps; ++step) {
    reset_counters(ctx);
    count.reset_peak();
    StepRecord rec;
    rec.step = step;
    rec.lr = lr_at(c.train.optimizer, c.train.lr_schedule, step, c.train.steps);
    optimizer->set_lr(rec.lr, c.train.optimizer.lr);
    const memory::MetaLimit::Armed armed;  // a MetaLimit stops the step where it passes the limit
    run_step(state, rec);
    out.step_peaks.push_back(count.peak());
    if (step == 1) out.terms = memory_terms(par, params, buffers_before, before, count.live());
    out.comm = comm_bytes(ctx);
  }
  return out;
}

}  // namespace composer

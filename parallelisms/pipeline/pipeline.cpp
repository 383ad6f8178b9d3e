#include "parallelisms/pipeline/pipeline.h"

#include <chrono>
#include <map>
#include <tuple>
#include <unordered_set>

#include "models/layers.h"
#include "parallelisms/comm/trace_span.h"
#include "parallelisms/parallel.h"

namespace composer::parallel {

std::optional<std::string> split_stages(const std::vector<models::PipelinePiece>& pieces, int stages,
                                        const std::vector<std::string>& split_points, int64_t layers_per_stage,
                                        std::vector<std::pair<size_t, size_t>>& ranges) {
  ranges.clear();
  if (pieces.empty()) return std::string("the model cannot be split into pipeline stages");
  std::vector<std::string> names;
  for (size_t i = 1; i < pieces.size(); ++i) names.push_back(pieces[i].name);
  auto list = [&] {
    std::string s;
    for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
    return s;
  };
  std::vector<size_t> starts{0};
  if (!split_points.empty()) {
    if (static_cast<int>(split_points.size()) != stages - 1) {
      return std::to_string(split_points.size()) + " split points make " + std::to_string(split_points.size() + 1) +
             " stages, but pp x virtual_stages is " + std::to_string(stages) + "; give " + std::to_string(stages - 1);
    }
    for (const auto& sp : split_points) {
      size_t at = 0;
      for (size_t i = 1; i < pieces.size(); ++i) {
        if (pieces[i].name == sp) at = i;
      }
      if (at == 0) return "split point '" + sp + "' is not where a stage can start; valid: " + list();
      if (at <= starts.back()) return "split point '" + sp + "' does not come after the previous one";
      starts.push_back(at);
    }
  } else {
    std::vector<size_t> layers;
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i].layer) layers.push_back(i);
    }
    const int64_t n = static_cast<int64_t>(layers.size());
    const int64_t k = layers_per_stage ? layers_per_stage : (n % stages == 0 ? n / stages : 0);
    if (k == 0 || k * stages != n) {
      return "the model's " + std::to_string(n) + " layers do not split into " + std::to_string(stages) +
             " stages" + (layers_per_stage ? " of " + std::to_string(layers_per_stage) + " layers" : std::string()) +
             "; give split_points (valid: " + list() + ") or a layers_per_stage such that layers_per_stage x " + std::to_string(stages) + " = " + std::to_string(n);
    }
    for (int s = 1; s < stages; ++s) starts.push_back(layers[s * k]);
  }
  starts.push_back(pieces.size());
  for (int s = 0; s < stages; ++s) ranges.emplace_back(starts[s], starts[s + 1]);
  return std::nullopt;
}

struct Pipeline::Slot {
  torch::Tensor input;       // the stage's input (a leaf requiring grad after stage 0)
  torch::Tensor output;      // the stage's output, or the loss on the last stage
  torch::Tensor grad_out;    // the gradient of `output` (received, or handed over locally)
  torch::Tensor input_grad;  // the gradient of `input`, once computed
  // Zero-bubble schedules: what the stage's Linear layers recorded in
  // forward (and backward) for the W action.
  nn::WeightGradRecords weight_grads;
};

namespace {

bool is_float(const torch::Tensor& t) { return t.is_floating_point(); }

double now_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace {

// One stage as a module: its forward runs the stage's pieces in order. Its
// children stay the model's; the stage's root lists them by their FQNs.
class Stage : public nn::Module {
 public:
  explicit Stage(std::vector<models::PipelinePiece> pieces) : nn::Module("PipelineStage"), pieces_(std::move(pieces)) {}
  torch::Tensor forward(torch::Tensor x) override {
    for (const auto& p : pieces_) x = p.run(x);
    return x;
  }

 private:
  std::vector<models::PipelinePiece> pieces_;
};

// The root of stage `s`: the stage module, then every module its pieces
// compute with and the modules below those, each once, by model FQN.
models::Root stage_root(int s, nn::Module& stage, const std::vector<std::string>& names,
                        const models::NamedModules& all) {
  models::Root root{"stage " + std::to_string(s), &stage, {{"", &stage}}};
  std::unordered_set<const nn::Module*> seen;
  for (const auto& name : names) {
    for (const auto& [fqn, m] : all) {
      if ((fqn == name || fqn.rfind(name + ".", 0) == 0) && seen.insert(m).second) root.modules.emplace_back(fqn, m);
    }
  }
  return root;
}

}  // namespace

Pipeline::Pipeline(models::Model& model, Group& pp, const PipelineOptions& options)
    : group_(pp), options_(options) {
  shape_ = shape_for(options.schedule, pp.size, options.virtual_stages, options.microbatches);
  if (auto why = check_shape(options.schedule, shape_)) TORCH_CHECK(false, *why);
  pieces_ = model.pipeline_pieces();
  if (auto why = split_stages(pieces_, shape_.stages(), options.split_points, options.layers_per_stage, ranges_)) {
    TORCH_CHECK(false, *why);
  }
  actions_ = with_communication(compute_schedule(options.schedule, shape_), shape_);
  for (const auto& rank_actions : actions_) {
    for (const Action& a : rank_actions) {
      if (a.op == Op::kBackwardWeight) deferred_.emplace(a.stage, a.microbatch);
    }
  }
  const P2POrder order = options.p2p_order.value_or(p2p_order_for(pp.backend));
  std::vector<RankActions> evaluation;
  for (int r = 0; r < shape_.pp; ++r) evaluation.push_back(evaluation_actions(shape_, r));
  program_ = p2p_programs(actions_, order)[pp.rank];
  eval_program_ = p2p_programs(evaluation, order)[pp.rank];
  device_ = nn::param_options().device();  // meta in a dry run
  cut_stages(model);
  if (options.every_stage) return;  // a shape-only copy: nothing placed, nothing dropped
  place_params(model);
}

// Which ranks hold each parameter, and this rank's stages as roots.
void Pipeline::cut_stages(models::Model& model) {
  const models::NamedModules all = nn::named_modules(model);
  std::map<std::string, nn::Module*> modules(all.begin(), all.end());
  const int S = shape_.stages();
  stages_.resize(S);
  for (int s = 0; s < S; ++s) {
    std::vector<std::string> names;
    for (size_t i = ranges_[s].first; i < ranges_[s].second; ++i) {
      for (const auto& name : pieces_[i].modules) {
        auto it = modules.find(name);
        TORCH_CHECK(it != modules.end(), "pipeline piece ", pieces_[i].name, " names no module ", name);
        names.push_back(name);
        auto add_holder = [&](const torch::Tensor& t) {
          auto& info = params_[t.unsafeGetTensorImpl()];
          const int r = shape_.rank_of(s);
          if (std::find(info.ranks.begin(), info.ranks.end(), r) == info.ranks.end()) info.ranks.push_back(r);
          std::sort(info.ranks.begin(), info.ranks.end());
        };
        for (auto& item : it->second->named_parameters(/*recurse=*/true)) add_holder(item.value());
        for (auto& item : it->second->named_buffers(/*recurse=*/true)) add_holder(item.value());
      }
    }
    if (!local(s)) continue;
    stages_[s] = std::make_shared<Stage>(
        std::vector<models::PipelinePiece>(pieces_.begin() + ranges_[s].first, pieces_.begin() + ranges_[s].second));
    roots_.push_back(stage_root(s, *stages_[s], names, all));
  }
}

// Every parameter's and buffer's placement on pp; this rank keeps only its stages' parameters.
void Pipeline::place_params(models::Model& model) {
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    auto& info = params_[p.unsafeGetTensorImpl()];
    TORCH_CHECK(!info.ranks.empty(), "parameter ", name, " is in no pipeline piece of ", model.type());
    info.shape = p.sizes().vec();
    info.dtype = p.scalar_type();
    if (options_.placements) {
      SpecDim d{group_.name, &group_, group_.size, group_.rank, Placement::replicate(), Placement::partial(Reduce::kSum)};
      d.members = info.ranks;
      if (info.ranks.size() > 1 && holds(p)) {
        TORCH_CHECK(options_.subgroup, "pipeline: a parameter held by several stages needs a subgroup factory");
        d.member_group = options_.subgroup(info.ranks);
      }
      options_.placements->add(p, d);
    }
    if (!holds(p)) p.set_data(torch::empty({0}, p.options()));
  }
  // Buffers are held where their modules are, as parameters; a rank keeps
  // the others' (nothing reads them there) but neither saves nor loads them.
  if (!options_.placements) return;
  for (const auto& b : model.named_buffers(/*recurse=*/true)) {
    auto it = params_.find(b.value().unsafeGetTensorImpl());
    if (it == params_.end()) continue;  // in no piece: whole on every rank, like an unplaced tensor
    SpecDim d{group_.name, &group_, group_.size, group_.rank, Placement::replicate(), Placement::replicate()};
    d.members = it->second.ranks;
    options_.placements->add(b.value(), d);
  }
}

Pipeline::~Pipeline() = default;

StageShapes Pipeline::trace(torch::Tensor x) {
  TORCH_INTERNAL_ASSERT(options_.every_stage, "trace() runs every stage: build the pipeline with every_stage");
  torch::NoGradGuard no_grad;
  StageShapes out;
  for (int s = 0; s < shape_.stages(); ++s) {
    out.input.push_back(x.sizes().vec());
    out.input_dtype.push_back(x.scalar_type());
    x = stage_forward(s, x);
    out.output.push_back(x.sizes().vec());
  }
  return out;
}

torch::Tensor Pipeline::stage_forward(int stage, torch::Tensor x) {
  TORCH_INTERNAL_ASSERT(stages_[stage], "stage ", stage, " is not on this rank");
  return (*stages_[stage])(x);
}

bool Pipeline::holds(const torch::Tensor& p) const {
  auto it = params_.find(p.unsafeGetTensorImpl());
  if (it == params_.end()) return false;
  const auto& r = it->second.ranks;
  return std::find(r.begin(), r.end(), group_.rank) != r.end();
}

// One run()'s state: every (stage, microbatch) slot, the groups of sends and
// receives in flight, the functions that give inputs and losses, and the loss so far.
struct Pipeline::Run {
  const std::function<torch::Tensor(int)>& input_of;
  const std::function<torch::Tensor(int, const torch::Tensor&)>& loss_of;
  double loss_factor;
  const std::function<void(int)>& enter;  // before each compute action of a microbatch, when given
  std::map<std::pair<int, int>, Slot> slots;
  // The groups issued and not yet waited for: the handle and the receives' buffers.
  struct Posted {
    Handle handle;
    std::vector<std::pair<Action, torch::Tensor>> received;
  };
  std::map<int, Posted> posted;
  double loss_sum = 0;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
};

// The tensor backward starts from for (stage s, microbatch mb) and its gradient.
std::pair<torch::Tensor, torch::Tensor> Pipeline::backward_root(Run& run, int s, int mb) {
  Slot& slot = run.slots[{s, mb}];
  if (s == shape_.stages() - 1) return {slot.output * run.loss_factor, torch::Tensor()};
  if (shape_.rank_of(s + 1) == group_.rank) return {slot.output, run.slots[{s + 1, mb}].input_grad};
  return {slot.output, slot.grad_out};
}

// A forward action: the stage's input (the batch's, handed over from this
// rank's previous stage, or received), its forward and, on the last stage,
// the microbatch's loss.
void Pipeline::forward(int s, int mb, Run& run) {
  Slot& slot = run.slots[{s, mb}];
  if (s == 0) {
    slot.input = run.input_of(mb);
  } else if (shape_.rank_of(s - 1) == group_.rank) {
    auto x = run.slots[{s - 1, mb}].output.detach();
    slot.input = is_float(x) ? x.requires_grad_() : x;
  }
  torch::Tensor out;
  {
    nn::DeferWeightGrads defer(deferred_.count({s, mb}) ? &slot.weight_grads : nullptr);
    out = stage_forward(s, slot.input);
  }
  if (s == shape_.stages() - 1) {
    out = run.loss_of(mb, out);
    losses_[mb] = out.is_meta() ? 0.0 : out.item<double>();  // a dry run has no values
    run.loss_sum += losses_[mb];
  }
  slot.output = out;
}

// A group's sends (the slots' outputs and input gradients) and receives
// (buffers of the stage shapes), issued together.
void Pipeline::issue(const P2PStep& step, Run& run) {
  std::vector<P2POp> ops;
  Run::Posted& posted = run.posted[step.group];
  for (const Action& a : step.comm) {
    const int s = a.stage, mb = a.microbatch;
    P2POp op{true, {}, p2p_peer(a, shape_), p2p_tag(a, shape_), a.str()};
    switch (a.op) {
      case Op::kSendActivation: op.tensor = run.slots[{s, mb}].output.detach(); break;
      case Op::kSendGradient: op.tensor = run.slots[{s, mb}].input_grad; break;
      case Op::kRecvActivation:
        op.send = false;
        op.tensor = torch::empty(shapes_.input[s], torch::TensorOptions().dtype(shapes_.input_dtype[s]).device(device_));
        break;
      case Op::kRecvGradient:  // the gradient of this stage's output, which the next stage received as its input
        op.send = false;
        op.tensor = torch::empty(shapes_.output[s], torch::TensorOptions().dtype(shapes_.input_dtype[s + 1]).device(device_));
        break;
      default: TORCH_INTERNAL_ASSERT(false, "a group holds ", a.str());
    }
    if (!op.send) posted.received.emplace_back(a, op.tensor);
    ops.push_back(std::move(op));
  }
  posted.handle = issue_group(group_, ops);
}

void Pipeline::deliver(int group, Run& run) {
  auto node = run.posted.extract(group);
  TORCH_INTERNAL_ASSERT(node, "pipeline: group ", group, " waited for twice");
  node.mapped().handle.wait();
  for (auto& [a, buf] : node.mapped().received) {
    Slot& slot = run.slots[{a.stage, a.microbatch}];
    if (a.op == Op::kRecvGradient) {
      slot.grad_out = buf;
    } else {
      slot.input = is_float(buf) ? buf.requires_grad_() : buf;
    }
  }
}

void Pipeline::act(const Action& a, Run& run) {
  const int s = a.stage, mb = a.microbatch;
  Slot& slot = run.slots[{s, mb}];
  if (run.enter) run.enter(mb);
  switch (a.op) {
    case Op::kForward:
      forward(s, mb, run);
      break;
    case Op::kBackward:
    case Op::kBackwardInput: {
      // Under a zero-bubble schedule (I), the stage's one backward gives the
      // input gradient and every parameter gradient except the Linear weights
      // and biases, whose layers only record their output gradients (deferred
      // mode, see forward); W computes those.
      auto [root, grad] = backward_root(run, s, mb);
      torch::autograd::backward({root}, {grad});
      if (s > 0 && slot.input.requires_grad()) slot.input_grad = slot.input.grad();
      slot.output = torch::Tensor();
      break;
    }
    case Op::kBackwardWeight:
      // The deferred Linear gradients from what I kept: no second traversal of the stage.
      slot.weight_grads.backward();
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "pipeline: ", a.str(), " is not a compute action");
  }
}

void Pipeline::execute(const P2PProgram& program, Run& run, const std::string& what, bool timed) {
  // What a step does, for errors and trace spans only: "F3.1", "SEND_F1.0 RECV_B1.0", "wait group 2".
  auto name_of_step = [](const P2PStep& step) {
    if (step.kind == P2PStep::kCompute) return step.action.str();
    if (step.kind == P2PStep::kWait) return "wait group " + std::to_string(step.group);
    std::string name;
    for (const Action& a : step.comm) name += (name.empty() ? "" : " ") + a.str();
    return name;
  };
  for (const P2PStep& step : program) {
    const double start = now_ms(run.t0);
    try {
      TraceSpan span([&] { return what + name_of_step(step); });
      if (step.kind == P2PStep::kCompute) act(step.action, run);
      else if (step.kind == P2PStep::kIssue) issue(step, run);
      else deliver(step.group, run);
    } catch (const c10::Error& e) {  // name the step: a schedule runs many
      TORCH_CHECK(false, what, "action ", name_of_step(step), ": ", e.what_without_backtrace());
    }
    if (timed && step.kind == P2PStep::kCompute) timeline_.push_back({step.action.str(), start, now_ms(run.t0)});
  }
  TORCH_INTERNAL_ASSERT(run.posted.empty(), "pipeline: a group issued was never waited for");
}

double Pipeline::run(const std::function<torch::Tensor(int)>& input_of,
                     const std::function<torch::Tensor(int, const torch::Tensor&)>& loss_of, double grad_scale,
                     const std::function<void(int)>& enter) {
  const double loss_factor = options_.loss_factor * grad_scale;
  TORCH_INTERNAL_ASSERT(static_cast<int>(shapes_.input.size()) == shape_.stages(),
                        "the pipeline's stage shapes were never set");
  timeline_.clear();
  losses_.assign(shape_.microbatches, 0.0);
  Run run{input_of, loss_of, loss_factor, enter, {}, {}, 0};
  execute(program_, run, "pipeline ", /*timed=*/true);
  for (const auto& [key, slot] : run.slots) {
    TORCH_INTERNAL_ASSERT(slot.weight_grads.empty(), "stage ", key.first, " microbatch ", key.second,
                          " kept deferred weight gradients that no W action used");
  }
  return run.loss_sum;
}

double Pipeline::evaluate(const std::function<torch::Tensor(int)>& input_of,
                          const std::function<torch::Tensor(int, const torch::Tensor&)>& loss_of,
                          const std::function<void(int)>& enter) {
  TORCH_INTERNAL_ASSERT(!torch::GradMode::is_enabled(), "Pipeline::evaluate runs without gradients");
  const std::vector<double> kept = losses_;
  losses_.assign(shape_.microbatches, 0.0);
  Run run{input_of, loss_of, 0.0, enter, {}, {}, 0};
  // In one global order (microbatch, then stage): every rank's receive meets
  // a send issued earlier in that order.
  execute(eval_program_, run, "eval pipeline ", /*timed=*/false);
  losses_ = kept;
  return run.loss_sum;
}

double pipeline_loss_factor(bool scale_grads, bool sum_loss, int64_t microbatches) {
  const double n = static_cast<double>(microbatches);
  return sum_loss ? (scale_grads ? 1.0 / n : 1.0) : (scale_grads ? 1.0 : n);
}

namespace {

// The stage shapes: the pipeline's trace on a shape-only copy of the model,
// cut the same way with every stage held, through every later transform's
// trace() (tensor parallelism shards the twin as this rank's coordinate does,
// context parallelism slices the input as this rank holds it, the others
// change no edge).
StageShapes trace_stages(const Applying& a, Group& group, const PipelineOptions& cut) {
  models::ModelPtr twin = a.o.shape_twin();
  twin->eval();
  PipelineOptions po = cut;
  po.every_stage = true;
  po.placements = nullptr;
  Pipeline every(*twin, group, po);
  Tracing t{every.roots(), a.o.microbatch().to(torch::kMeta), a.o, {}, {}};
  if (a.trace_later) a.trace_later(t);
  return every.trace(t.input);
}

}  // namespace

bool apply(Applying& a, const PipelineConfig& config) {
  Parallel& par = a.par;
  Group& group = a.group(config.mesh_dim);
  PipelineOptions po;
  static_cast<PipelineConfig&>(po) = config;
  po.placements = par.placements.get();
  DeviceMesh* mesh = a.o.mesh;
  const std::string dim = config.mesh_dim.front();
  po.subgroup = [mesh, dim](const std::vector<int>& members) { return &mesh->subgroup(dim, members); };
  par.pipe = std::make_unique<Pipeline>(a.model, group, po);
  par.roots = par.pipe->roots();
  if (a.o.microbatch && a.o.shape_twin) par.pipe->set_shapes(trace_stages(a, group, po));
  std::string stages;
  for (int st : par.pipe->local_stages()) stages += (stages.empty() ? "" : ", ") + std::to_string(st);
  a.log("applied pipeline " + over(&group) + ": " + name_of(config.schedule) + ", " +
        std::to_string(par.pipe->shape().stages()) + " stages, this rank runs stage" +
        (par.roots.size() == 1 ? " " : "s ") + stages);
  return true;
}

void trace(Tracing&, const PipelineConfig&) {
  TORCH_INTERNAL_ASSERT(false, "a pipeline cuts the model first: no transform before it traces stage shapes");
}

}  // namespace composer::parallel

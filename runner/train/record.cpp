#include "runner/train/record.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "parallelisms/context_parallel.h"
#include "parallelisms/tensor_parallel.h"
#include "runner/base/errors.h"

namespace composer {

bool records_module(const RecordOptions& options, const std::string& fqn) {
  if (options.modules.empty()) return true;
  for (size_t end = 0; end != std::string::npos;) {  // the module or one it lies inside
    end = fqn.find('.', end ? end + 1 : 0);
    if (models::matches_any(options.modules, fqn.substr(0, end))) return true;
  }
  return false;
}

namespace {

// The box of parameter `h` that this rank holds (`t`: its value or gradient).
ParamBox held_box(const HeldParam& h, const torch::Tensor& t) {
  if (!h.spec) return {std::vector<int64_t>(t.dim(), 0), t.sizes().vec(), t.sizes().vec(), ""};
  const auto box = h.spec->box();
  return {box.offset, box.size, h.spec->global_shape, h.spec->str()};
}

}  // namespace

struct StepRecorder::State {
  std::vector<RecordEntry> entries;
  std::set<std::string> seen;                      // keys recorded or hooked
  std::map<std::string, int64_t> calls;            // forward calls per output key
  std::vector<std::pair<nn::Module*, int>> hooks;  // to remove at the end
  int64_t order = 0;                               // this rank's execution order
  bool on = false;
};

StepRecorder::StepRecorder(RecordOptions options, const std::vector<models::Root>& roots, const parallel::Parallel& par,
                           const std::vector<HeldParam>& held, int rank, RecordLayout layout)
    : options_(std::move(options)),
      par_(par),
      held_(held),
      rank_(rank),
      layout_(layout),
      state_(std::make_shared<State>()) {
  std::set<nn::Module*> taken;
  for (const auto& root : roots) {
    for (const auto& [name, m] : root.modules) {
      // A pipeline stage's root stands for no module of the model.
      if (name.empty() && !root.name.empty()) continue;
      if (!records_module(options_, name)) continue;
      if (taken.insert(m).second) modules_.emplace_back(name, m);
    }
  }
}

StepRecorder::~StepRecorder() {
  for (auto& [m, h] : state_->hooks) m->remove_hook(h);
}

void StepRecorder::add(RecordKind kind, const std::string& name, const std::string& type, int64_t mb,
                       const torch::Tensor& t, PiecePlace where) {
  RecordEntry e;
  e.key = record_key(kind, mb, name);
  e.kind = kind;
  e.module = name;
  e.type = type;
  e.microbatch = mb;
  e.order = state_->order++;
  e.where = std::move(where);
  // One file per tensor, written as it is recorded: the rank holds one
  // recorded tensor at a time, whatever the model's size.
  e.file = "rank" + std::to_string(rank_) + "/" + std::to_string(e.order) + ".safetensors";
  state_->seen.insert(e.key);
  // float64 stays float64 (its tolerances are below float32's resolution); bfloat16 and float16 widen.
  const auto dtype = t.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  write_safetensors(files_dir_ + "/" + e.file,
                    {{e.key, t.detach().to(torch::kCPU, dtype, /*non_blocking=*/false, /*copy=*/true)}});
  state_->entries.push_back(std::move(e));
}

// Where an activation piece of this rank's current microbatch lies: its
// samples in the global batch, its sequence positions under context
// parallelism, its tensor-parallel rank.
PiecePlace StepRecorder::activation_where() const {
  PiecePlace w;
  w.first_sample = layout_.batch_begin + microbatch_ * layout_.microbatch;
  w.samples = layout_.microbatch;
  if (par_.cp && layout_.seq_len > 0) {
    const int64_t local = layout_.seq_len / par_.cp->group().size;
    auto pos = par_.cp->positions(local, torch::kCPU).contiguous();
    w.positions.assign(pos.data_ptr<int64_t>(), pos.data_ptr<int64_t>() + pos.numel());
    w.cp = GroupRank{par_.cp->group().rank, par_.cp->group().size};
  }
  if (par_.tp) w.tp = GroupRank{par_.tp->group().rank, par_.tp->group().size};
  return w;
}

// Every parameter piece this rank holds of the recorded modules: its value,
// or its gradient for kParamGrad.
void StepRecorder::add_params(RecordKind kind) {
  for (const auto& h : held_) {
    if (h.buffer) continue;
    if (h.spec && !h.spec->held()) continue;
    const size_t dot = h.name.rfind('.');
    if (!records_module(options_, dot == std::string::npos ? "" : h.name.substr(0, dot))) continue;
    torch::Tensor t = kind == RecordKind::kParamGrad ? h.param.grad() : h.param;
    if (!t.defined()) continue;
    PiecePlace where;
    where.box = held_box(h, t);
    const auto shape = where.box->size;
    add(kind, h.name, "", 0, t.reshape(shape), std::move(where));
  }
}

// Hooks module `m` (FQN `name`): its output in each microbatch's first
// forward, and the gradient flowing back into its input.
void StepRecorder::hook(const std::string& name, nn::Module* m) {
  auto state = state_;
  const std::string type = m->type();
  // First: the input as the caller gave it, before any transform's hook, so
  // the gradient recorded is the one flowing back to the caller.
  state->hooks.emplace_back(m, m->add_pre_hook_first([this, state, name, type](nn::Module&, torch::Tensor x) {
    if (!x.defined() || !x.is_floating_point() || !x.requires_grad() || !torch::GradMode::is_enabled()) return x;
    const int64_t mb = microbatch_;
    if (!state->seen.insert(record_key(RecordKind::kInputGrad, mb, name)).second) return x;
    auto where = activation_where();
    auto v = x.view_as(x);
    v.register_hook(
        [this, name, type, mb, where](torch::Tensor g) { add(RecordKind::kInputGrad, name, type, mb, g, where); });
    return v;
  }));
  state->hooks.emplace_back(
      m, m->add_post_hook([this, state, name, type](nn::Module&, const torch::Tensor&, torch::Tensor y) {
        if (!y.defined() || !y.is_floating_point()) return y;
        const std::string key = record_key(RecordKind::kOutput, microbatch_, name);
        ++state->calls[key];
        if (!state->seen.count(key)) add(RecordKind::kOutput, name, type, microbatch_, y, activation_where());
        return y;
      }));
}

void StepRecorder::open_files_dir(const std::string& dir) {
  files_dir_ = dir;
  std::error_code ec;
  std::filesystem::create_directories(files_dir_ + "/rank" + std::to_string(rank_), ec);
  if (ec) throw RuntimeFailure("cannot create " + files_dir_ + ": " + ec.message());
}

void StepRecorder::begin() {
  open_files_dir(options_.dir);
  add_params(RecordKind::kParamBefore);
  for (const auto& [name, m] : modules_) hook(name, m);
  state_->on = true;
}

void StepRecorder::after_grad_sync() {
  if (state_->on) add_params(RecordKind::kParamGrad);
}

void StepRecorder::end() {
  if (!state_->on) return;
  add_params(RecordKind::kParamAfter);
  for (auto& [m, h] : state_->hooks) m->remove_hook(h);
  state_->hooks.clear();
  state_->on = false;
  write_entries(options_.dir, options_.step);
}

void StepRecorder::write_entries(const std::string& dir, int64_t step) {
  for (auto& e : state_->entries) {  // one device's counts tell a module called more than once (recomputation aside)
    if (e.kind == RecordKind::kOutput) e.calls = state_->calls[e.key];
  }
  RankRecord r;
  r.rank = rank_;
  r.step = step;
  r.global_batch = layout_.global_batch;
  r.seq_len = layout_.seq_len;
  r.local_batch = layout_.local_batch;
  r.grad_divisor = layout_.grad_divisor;
  r.entries = std::move(state_->entries);
  const std::string base = dir + "/rank" + std::to_string(rank_);
  std::ofstream f(base + ".json");
  f << nlohmann::json(r).dump(1) << "\n";
  if (!f.good()) throw RuntimeFailure("cannot write " + base + ".json");
  state_->entries.clear();
  state_->seen.clear();
  state_->calls.clear();
  state_->order = 0;
}

void StepRecorder::params_after(int64_t step) {
  open_files_dir(options_.dir + "/step" + std::to_string(step));
  add_params(RecordKind::kParamAfter);
  write_entries(files_dir_, step);
}

}  // namespace composer

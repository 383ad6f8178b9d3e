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

struct StepRecorder::State {
  nlohmann::json entries = nlohmann::json::array();
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

void StepRecorder::add(const std::string& kind, const std::string& name, const std::string& type, int64_t mb,
                       const torch::Tensor& t, nlohmann::json where) {
  const std::string key = kind + "/" + std::to_string(mb) + "/" + name;
  state_->seen.insert(key);
  state_->entries.push_back({{"key", key},
                             {"kind", kind},
                             {"module", name},
                             {"type", type},
                             {"microbatch", mb},
                             {"order", state_->order++},
                             {"where", std::move(where)}});
  // One file per tensor, written as it is recorded: the rank holds one
  // recorded tensor at a time, whatever the model's size.
  const std::string file = "rank" + std::to_string(rank_) + "/" + std::to_string(state_->order - 1) + ".safetensors";
  state_->entries.back()["file"] = file;
  // float64 stays float64 (its tolerances are below float32's resolution); bfloat16 and float16 widen.
  const auto dtype = t.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  write_safetensors(files_dir_ + "/" + file,
                    {{key, t.detach().to(torch::kCPU, dtype, /*non_blocking=*/false, /*copy=*/true)}});
}

// Where an activation piece of this rank's current microbatch lies: its
// samples in the global batch, its sequence positions under context
// parallelism, its tensor-parallel rank (a dim the comparison finds smaller
// than the whole is that rank's torch.chunk piece).
nlohmann::json StepRecorder::activation_where() const {
  nlohmann::json w;
  w["samples"] = {layout_.batch_begin + microbatch_ * layout_.microbatch, layout_.microbatch};
  if (par_.cp && layout_.seq_len > 0) {
    const int64_t local = layout_.seq_len / par_.cp->group().size;
    auto pos = par_.cp->positions(local, torch::kCPU).contiguous();
    w["positions"] = std::vector<int64_t>(pos.data_ptr<int64_t>(), pos.data_ptr<int64_t>() + pos.numel());
    w["cp"] = {par_.cp->group().rank, par_.cp->group().size};
  }
  if (par_.tp) w["tp"] = {par_.tp->group().rank, par_.tp->group().size};
  return w;
}

void StepRecorder::add_params(const std::string& kind, bool grads) {
  for (const auto& h : held_) {
    if (h.buffer) continue;
    if (h.spec && !h.spec->held()) continue;
    const size_t dot = h.name.rfind('.');
    if (!records_module(options_, dot == std::string::npos ? "" : h.name.substr(0, dot))) continue;
    torch::Tensor t = grads ? h.param.grad() : h.param;
    if (!t.defined()) continue;
    nlohmann::json where;
    if (h.spec) {
      const auto box = h.spec->box();
      where["offset"] = box.offset;
      where["size"] = box.size;
      where["global"] = h.spec->global_shape;
      where["placement"] = h.spec->str();
    } else {
      where["offset"] = std::vector<int64_t>(t.dim(), 0);
      where["size"] = t.sizes().vec();
      where["global"] = t.sizes().vec();
    }
    const auto shape = where["size"].get<std::vector<int64_t>>();
    add(kind, h.name, "", 0, t.reshape(shape), std::move(where));
  }
}

void StepRecorder::begin() {
  files_dir_ = options_.dir;
  std::error_code ec;
  std::filesystem::create_directories(files_dir_ + "/rank" + std::to_string(rank_), ec);
  if (ec) throw RuntimeFailure("cannot create " + files_dir_ + ": " + ec.message());
  add_params("param_before", /*grads=*/false);
  auto state = state_;
  for (const auto& [name, m] : modules_) {
    const std::string type = m->type();
    // First: the input as the caller gave it, before any transform's hook, so
    // the gradient recorded is the one flowing back to the caller.
    state->hooks.emplace_back(m, m->add_pre_hook_first([this, state, name, type](nn::Module&, torch::Tensor x) {
      if (!x.defined() || !x.is_floating_point() || !x.requires_grad() || !torch::GradMode::is_enabled()) return x;
      const int64_t mb = microbatch_;
      const std::string key = "input_grad/" + std::to_string(mb) + "/" + name;
      if (!state->seen.insert(key).second) return x;
      auto where = activation_where();
      auto v = x.view_as(x);
      v.register_hook([this, name, type, mb, where](torch::Tensor g) { add("input_grad", name, type, mb, g, where); });
      return v;
    }));
    state->hooks.emplace_back(
        m, m->add_post_hook([this, state, name, type](nn::Module&, const torch::Tensor&, torch::Tensor y) {
          if (!y.defined() || !y.is_floating_point()) return y;
          const std::string key = "output/" + std::to_string(microbatch_) + "/" + name;
          ++state->calls[key];
          if (!state->seen.count(key)) add("output", name, type, microbatch_, y, activation_where());
          return y;
        }));
  }
  state_->on = true;
}

void StepRecorder::after_grad_sync() {
  if (state_->on) add_params("param_grad", /*grads=*/true);
}

void StepRecorder::end() {
  if (!state_->on) return;
  add_params("param_after", /*grads=*/false);
  for (auto& [m, h] : state_->hooks) m->remove_hook(h);
  state_->hooks.clear();
  state_->on = false;
  write_entries(options_.dir, options_.step);
}

void StepRecorder::write_entries(const std::string& dir, int64_t step) {
  for (auto& e : state_->entries) {  // one device's counts tell a module called more than once (recomputation aside)
    if (e["kind"] == "output") e["calls"] = state_->calls[e["key"].get<std::string>()];
  }
  const std::string base = dir + "/rank" + std::to_string(rank_);
  nlohmann::json j = {{"rank", rank_},
                      {"step", step},
                      {"global_batch", layout_.global_batch},
                      {"seq_len", layout_.seq_len},
                      {"local_batch", layout_.local_batch},
                      {"grad_divisor", layout_.grad_divisor},
                      {"entries", state_->entries}};
  std::ofstream f(base + ".json");
  f << j.dump(1) << "\n";
  if (!f.good()) throw RuntimeFailure("cannot write " + base + ".json");
  state_->entries = nlohmann::json::array();
  state_->seen.clear();
  state_->calls.clear();
  state_->order = 0;
}

void StepRecorder::params_after(int64_t step) {
  files_dir_ = options_.dir + "/step" + std::to_string(step);
  std::error_code ec;
  std::filesystem::create_directories(files_dir_ + "/rank" + std::to_string(rank_), ec);
  if (ec) throw RuntimeFailure("cannot create " + files_dir_ + ": " + ec.message());
  add_params("param_after", /*grads=*/false);
  write_entries(files_dir_, step);
}

}  // namespace composer

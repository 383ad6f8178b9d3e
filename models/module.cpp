#include "models/module.h"

#include <unordered_set>

namespace composer::nn {

namespace {
thread_local bool shape_only = false;
thread_local DeferInit* deferring = nullptr;
thread_local c10::Device run_device = c10::kCPU;
}  // namespace

torch::TensorOptions param_options() {
  return torch::TensorOptions().device(shape_only || deferring ? c10::Device(torch::kMeta) : run_device);
}

torch::TensorOptions buffer_options() {
  return torch::TensorOptions().device(shape_only ? c10::Device(torch::kMeta) : run_device);
}

OnDevice::OnDevice(c10::Device device) : previous_(run_device) { run_device = device; }
OnDevice::~OnDevice() { run_device = previous_; }

ShapeOnly::ShapeOnly() : previous_(shape_only) { shape_only = true; }
ShapeOnly::~ShapeOnly() { shape_only = previous_; }

DeferInit::DeferInit() : previous_(deferring) { deferring = this; }
DeferInit::~DeferInit() { deferring = previous_; }

torch::Tensor new_param(std::vector<int64_t> shape, const Fill& fill) {
  torch::Tensor p = torch::empty(shape, param_options());
  init_param(p, fill);
  return p;
}

void init_param(const torch::Tensor& p, const Fill& fill) {
  if (deferring && p.is_meta()) {
    deferring->steps_.push_back({p.unsafeGetTensorImpl(), p.sizes().vec(), fill});
    return;
  }
  torch::NoGradGuard no_grad;
  torch::Tensor t = p;
  fill(t);
}

torch::Tensor Module::operator()(torch::Tensor input) {
  for (auto& [handle, hook] : pre_hooks_) input = hook(*this, std::move(input));
  torch::Tensor output =
      wrapper_ ? wrapper_(*this, input, [this](const torch::Tensor& x) { return forward(x); }) : forward(input);
  for (auto& [handle, hook] : post_hooks_) output = hook(*this, input, std::move(output));
  return output;
}

int Module::add_pre_hook(PreHook hook) {
  pre_hooks_.emplace_back(next_handle_, std::move(hook));
  return next_handle_++;
}

int Module::add_pre_hook_first(PreHook hook) {
  pre_hooks_.emplace(pre_hooks_.begin(), next_handle_, std::move(hook));
  return next_handle_++;
}

int Module::add_post_hook(PostHook hook) {
  post_hooks_.emplace_back(next_handle_, std::move(hook));
  return next_handle_++;
}

void Module::remove_hook(int handle) {
  auto drop = [handle](auto& hooks) {
    for (auto it = hooks.begin(); it != hooks.end(); ++it) {
      if (it->first == handle) {
        hooks.erase(it);
        return;
      }
    }
  };
  drop(pre_hooks_);
  drop(post_hooks_);
}

const torch::Tensor& Module::param(const torch::Tensor& p) const {
  if (views_.empty()) return p;
  auto it = views_.find(p.unsafeGetTensorImpl());
  return it == views_.end() ? p : it->second;
}

void Module::set_view(const torch::Tensor& p, torch::Tensor view) {
  views_[p.unsafeGetTensorImpl()] = std::move(view);
}

void Module::clear_view(const torch::Tensor& p) { views_.erase(p.unsafeGetTensorImpl()); }

Sequential::Sequential(std::vector<ModulePtr> children) : Module("Sequential") {
  for (auto& c : children) push_back(std::move(c));
}

void Sequential::push_back(ModulePtr child) {
  register_module(std::to_string(items_.size()), child);
  items_.push_back(std::move(child));
}

torch::Tensor Sequential::forward(torch::Tensor x) {
  for (auto& m : items_) x = (*m)(x);
  return x;
}

void ModuleList::push_back(ModulePtr child) {
  register_module(std::to_string(items_.size()), child);
  items_.push_back(std::move(child));
}

torch::Tensor ModuleList::forward(torch::Tensor) {
  TORCH_INTERNAL_ASSERT(false, "ModuleList has no forward; its owner iterates it");
}

std::vector<std::pair<std::string, Module*>> named_modules(Module& root) {
  std::vector<std::pair<std::string, Module*>> out;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    if (auto* m = dynamic_cast<Module*>(item.value().get())) out.emplace_back(item.key(), m);
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> unique_named_parameters(torch::nn::Module& root) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
      out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> named_weight_buffers(torch::nn::Module& root) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : root.named_buffers(/*recurse=*/true)) {
    if (item.value().is_floating_point()) out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace composer::nn

// composer's module base: a torch::nn::Module whose call operator runs
// pre-forward hooks, forward and post-forward hooks, and whose layers read their
// parameters through param(), so a transform can swap in another view of a
// parameter (an all-gathered weight, a local shard) without the layer knowing.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace composer::nn {

class Module : public torch::nn::Module {
 public:
  // A pre-hook may replace the input; a post-hook may replace the output.
  using PreHook = std::function<torch::Tensor(Module&, torch::Tensor input)>;
  using PostHook =
      std::function<torch::Tensor(Module&, const torch::Tensor& input, torch::Tensor output)>;

  explicit Module(std::string type_name) : torch::nn::Module(type_name), type_(std::move(type_name)) {}

  // Runs pre-hooks, forward, post-hooks.
  torch::Tensor operator()(torch::Tensor input);
  virtual torch::Tensor forward(torch::Tensor input) = 0;

  // Runs in place of forward, between the pre- and post-hooks: it gets the
  // input and a function that runs this module's forward, and returns the
  // output (activation checkpointing decides there how forward runs). One per
  // module; an empty wrapper removes it.
  using Forward = std::function<torch::Tensor(const torch::Tensor&)>;
  using ForwardWrapper = std::function<torch::Tensor(Module&, const torch::Tensor& input, const Forward& forward)>;
  void set_forward_wrapper(ForwardWrapper wrapper) { wrapper_ = std::move(wrapper); }
  bool has_forward_wrapper() const { return static_cast<bool>(wrapper_); }

  int add_pre_hook(PreHook hook);
  // Runs before every pre-hook added so far (sees the input as the caller
  // gave it, before any transform's hook changes it).
  int add_pre_hook_first(PreHook hook);
  int add_post_hook(PostHook hook);
  void remove_hook(int handle);

  // The tensor a layer computes with for its registered parameter `p`: the
  // view a transform installed, or `p` itself.
  const torch::Tensor& param(const torch::Tensor& p) const;
  void set_view(const torch::Tensor& p, torch::Tensor view);
  void clear_view(const torch::Tensor& p);

  // PyTorch's class name ("Linear", "TransformerBlock"), for plans and errors.
  const std::string& type() const { return type_; }

 protected:
  // Registers a child and returns it typed.
  template <class M>
  std::shared_ptr<M> add(const std::string& name, std::shared_ptr<M> child) {
    register_module(name, child);
    return child;
  }

 private:
  std::string type_;
  int next_handle_ = 0;
  std::vector<std::pair<int, PreHook>> pre_hooks_;
  std::vector<std::pair<int, PostHook>> post_hooks_;
  ForwardWrapper wrapper_;
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> views_;
};

using ModulePtr = std::shared_ptr<Module>;

// Runs its children in registration order (nn.Sequential); children are named "0", "1", ...
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  explicit Sequential(std::vector<ModulePtr> children);
  void push_back(ModulePtr child);
  size_t size() const { return items_.size(); }
  const ModulePtr& at(size_t i) const { return items_.at(i); }
  torch::Tensor forward(torch::Tensor x) override;

 private:
  std::vector<ModulePtr> items_;
};

// Holds children named "0", "1", ... without a forward of its own (nn.ModuleList / ModuleDict).
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  void push_back(ModulePtr child);
  size_t size() const { return items_.size(); }
  const ModulePtr& at(size_t i) const { return items_.at(i); }
  torch::Tensor forward(torch::Tensor x) override;

 private:
  std::vector<ModulePtr> items_;
};

// Where models create their parameters: on the run's device (the CPU, or
// the GPU an OnDevice guard names), or on the meta device (shapes and dtypes,
// no storage) while a ShapeOnly or DeferInit guard lives on this thread, so
// that a plan can describe a model too large to build and a rank can build
// only what it holds. Transforms put their buffers there too.
torch::TensorOptions param_options();
// Where models create other tensors they keep (rotary tables): meta only
// under ShapeOnly; under DeferInit they are computed for real.
torch::TensorOptions buffer_options();

// The run's device for param_options and buffer_options while it lives on
// this thread (the CPU otherwise).
class OnDevice {
 public:
  explicit OnDevice(c10::Device device);
  ~OnDevice();
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  c10::Device previous_;
};

// Sets every value of a parameter without reading the old ones, as the
// nn.init functions do (it runs without autograd).
using Fill = std::function<void(torch::Tensor&)>;

// A new parameter tensor of `shape` (param_options()) whose values `fill`
// sets, and a later re-initialisation of one. Models set every initial value
// through these two, so that DeferInit can record the draws.
torch::Tensor new_param(std::vector<int64_t> shape, const Fill& fill);
void init_param(const torch::Tensor& p, const Fill& fill);

// While a DeferInit lives on this thread, parameters are created on meta and
// their fills are recorded in order, not run: replaying the steps in order on
// full-size float tensors draws every value exactly as building the model on
// the CPU does (the same generator stream), one tensor at a time.
class DeferInit {
 public:
  struct Step {
    const c10::TensorImpl* param;
    std::vector<int64_t> shape;  // the parameter's full shape
    Fill fill;
  };
  DeferInit();
  ~DeferInit();
  DeferInit(const DeferInit&) = delete;
  DeferInit& operator=(const DeferInit&) = delete;
  const std::vector<Step>& steps() const { return steps_; }

 private:
  friend void init_param(const torch::Tensor& p, const Fill& fill);
  DeferInit* previous_;
  std::vector<Step> steps_;
};

class ShapeOnly {
 public:
  ShapeOnly();
  ~ShapeOnly();
  ShapeOnly(const ShapeOnly&) = delete;
  ShapeOnly& operator=(const ShapeOnly&) = delete;

 private:
  bool previous_;
};

// Every composer module below `root` with its fully-qualified name, root first ("").
std::vector<std::pair<std::string, Module*>> named_modules(Module& root);

// Parameters by fully-qualified name, each tensor once (a tied weight keeps its
// first name, as PyTorch's named_parameters does), in PyTorch's order.
std::vector<std::pair<std::string, torch::Tensor>> unique_named_parameters(torch::nn::Module& root);
// The floating-point buffers by name (a router's expert bias, BatchNorm's
// running statistics): the state beside the parameters that weights files
// carry (init.safetensors, final.safetensors, a Hugging Face folder's), read
// back where a file holds them.
std::vector<std::pair<std::string, torch::Tensor>> named_weight_buffers(torch::nn::Module& root);

}  // namespace composer::nn

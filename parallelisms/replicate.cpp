#include "parallelisms/replicate.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

namespace composer::parallel {
namespace {

// Runs a callback after a parameter's AccumulateGrad node: the gradient of
// this backward (all uses of the parameter summed) is then in p.grad().
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  explicit ReadyHook(std::function<void()> f) : f_(std::move(f)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    f_();
    return outputs;
  }

 private:
  std::function<void()> f_;
};

}  // namespace

Replicate::Replicate(std::vector<torch::Tensor> params, Group& group, const ReplicateOptions& options)
    : params_(std::move(params)), group_(group) {
  // Buckets fill in reverse registration order, the order backward produces
  // gradients in, so early buckets launch while backward is still running.
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(options.bucket_mb * 1024 * 1024));
  bucket_of_.resize(params_.size());
  offset_of_.resize(params_.size());
  int64_t bytes = 0, numel = 0;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    const int64_t b = p.numel() * static_cast<int64_t>(p.element_size());
    bool new_bucket = buckets_.empty() || bytes + b > cap ||
                      buckets_.back().buffer.scalar_type() != p.scalar_type();
    if (new_bucket) {
      if (!buckets_.empty()) buckets_.back().buffer = torch::zeros({numel}, buckets_.back().buffer.options());
      buckets_.push_back({});
      buckets_.back().buffer = torch::empty({0}, p.options().requires_grad(false));
      bytes = numel = 0;
    }
    buckets_.back().params.push_back(k);
    bucket_of_[k] = buckets_.size() - 1;
    offset_of_[k] = static_cast<size_t>(numel);
    bytes += b;
    numel += p.numel();
  }
  if (!buckets_.empty()) buckets_.back().buffer = torch::zeros({numel}, buckets_.back().buffer.options());
  for (size_t k = 0; k < params_.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
    acc->add_post_hook(std::make_unique<ReadyHook>([this, k] { on_ready(k); }));
    accumulators_.push_back(acc);
  }
}

Replicate::~Replicate() = default;

void Replicate::on_ready(size_t k) {
  if (!sync_ || group_.size == 1) return;
  Bucket& b = buckets_[bucket_of_[k]];
  const auto& p = params_[k];
  b.buffer.narrow(0, static_cast<int64_t>(offset_of_[k]), p.numel()).copy_(p.grad().detach().reshape({-1}));
  if (++b.ready == b.params.size()) launch_in_order();
}

void Replicate::launch_in_order() {
  // Every rank launches buckets in the same order, whatever order they became
  // ready in, so the collectives match across ranks.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready == buckets_[next_launch_].params.size()) {
    Bucket& b = buckets_[next_launch_++];
    b.handle = all_reduce(group_, b.buffer, Reduce::kAvg, /*async=*/true);
    b.launched = true;
  }
}

void Replicate::finish() {
  if (group_.size == 1) return;
  for (auto& b : buckets_) {
    if (b.ready < b.params.size()) {
      // Gradients that arrived while sync was off, or never (as zeros).
      torch::NoGradGuard no_grad;
      for (size_t k : b.params) {
        auto dst = b.buffer.narrow(0, static_cast<int64_t>(offset_of_[k]), params_[k].numel());
        if (params_[k].grad().defined()) dst.copy_(params_[k].grad().detach().reshape({-1}));
        else dst.zero_();
      }
      b.ready = b.params.size();
    }
  }
  launch_in_order();
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b.handle.wait();
    for (size_t k : b.params) {
      auto& p = params_[k];
      auto synced = b.buffer.narrow(0, static_cast<int64_t>(offset_of_[k]), p.numel()).view(p.sizes());
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      p.mutable_grad().copy_(synced);
    }
    b.ready = 0;
    b.launched = false;
  }
  next_launch_ = 0;
}

std::unique_ptr<Replicate> apply_replicate(models::Model& model, Group& group, const ReplicateOptions& options) {
  std::vector<torch::Tensor> params;
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    if (options.param_filter && !options.param_filter(p)) continue;
    broadcast(group, p, 0);
    params.push_back(p);
  }
  return std::make_unique<Replicate>(params, group, options);
}

}  // namespace composer::parallel

#include "parallelisms/grad_sync.h"

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

const char* op_name(Reduce op) { return op == Reduce::kAvg ? "avg" : op == Reduce::kMax ? "max" : "sum"; }

}  // namespace

GradPlan grad_plan(const ShardSpec& spec) {
  GradPlan plan;
  for (const SpecDim& d : spec.dims) {
    if (!d.grad.is_partial()) continue;
    if (d.param.is_shard()) {
      if (d.size > 1) plan.reduce_scatters.push_back(d.name);
      continue;
    }
    const int size = d.members.empty() ? d.size : static_cast<int>(d.members.size());
    if (size < 2) continue;
    plan.all_reduces.push_back({d.members.empty() ? d.group : d.member_group, d.grad.reduce, d.name});
  }
  return plan;
}

std::string GradPlan::str() const {
  std::string s;
  for (const auto& d : reduce_scatters) s += (s.empty() ? "" : ", ") + std::string("reduce-scatter ") + d;
  for (const auto& r : all_reduces) {
    s += (s.empty() ? "" : ", ") + std::string("all-reduce ") + r.dim + " (" + op_name(r.op) + ")";
  }
  return s.empty() ? "none" : s;
}

GradSync::GradSync(std::vector<torch::Tensor> params, const Placements& placements, const GradSyncOptions& options) {
  // Buckets fill in reverse registration order, the order backward produces
  // gradients in, so early buckets launch while backward is still running.
  // Parameters share a bucket only when they need the same reductions.
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(options.bucket_mb * 1024 * 1024));
  std::vector<int64_t> bytes;  // per bucket
  std::vector<int64_t> numel;
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    const ShardSpec* spec = placements.find(p);
    if (!spec || !p.requires_grad()) continue;  // a frozen parameter (train.freeze) has no gradient
    auto reductions = grad_plan(*spec).all_reduces;
    if (reductions.empty()) continue;
    const int64_t b = p.numel() * static_cast<int64_t>(p.element_size());
    int open = -1;
    for (size_t i = buckets_.size(); i-- > 0;) {
      if (buckets_[i].reductions == reductions && buckets_[i].buffer.scalar_type() == p.scalar_type()) {
        open = static_cast<int>(i);
        break;
      }
    }
    if (open < 0 || bytes[open] + b > cap) {
      buckets_.push_back({});
      buckets_.back().reductions = reductions;
      buckets_.back().buffer = torch::empty({0}, p.options().requires_grad(false));
      bytes.push_back(0);
      numel.push_back(0);
      open = static_cast<int>(buckets_.size()) - 1;
    }
    const size_t idx = params_.size();
    params_.push_back(p);
    buckets_[open].params.push_back(idx);
    bucket_of_.push_back(static_cast<size_t>(open));
    offset_of_.push_back(static_cast<size_t>(numel[open]));
    bytes[open] += b;
    numel[open] += p.numel();
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    auto& b = buckets_[i];
    b.buffer = torch::zeros({numel[i] + static_cast<int64_t>(b.params.size())}, b.buffer.options());
  }
  for (size_t k = 0; k < params_.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
    acc->add_post_hook(std::make_unique<ReadyHook>([this, k] { on_ready(k); }));
    accumulators_.push_back(acc);
  }
}

GradSync::~GradSync() = default;

int64_t GradSync::buffer_bytes() const {
  int64_t n = 0;
  for (const auto& b : buckets_) n += b.buffer.numel() * static_cast<int64_t>(b.buffer.element_size());
  return n;
}

// Copies parameter k's gradient (or zeros) and its presence flag into its bucket.
void GradSync::fill(Bucket& b, size_t k) {
  torch::NoGradGuard no_grad;
  const auto& p = params_[k];
  auto dst = b.buffer.narrow(0, static_cast<int64_t>(offset_of_[k]), p.numel());
  const bool has = p.grad().defined();
  if (has) dst.copy_(p.grad().detach().reshape({-1}));
  else dst.zero_();
  const int64_t slot = b.buffer.numel() - static_cast<int64_t>(b.params.size());
  const auto pos = std::find(b.params.begin(), b.params.end(), k) - b.params.begin();
  b.buffer[slot + pos].fill_(has ? 1.0 : 0.0);
}

void GradSync::on_ready(size_t k) {
  if (!sync_) return;
  Bucket& b = buckets_[bucket_of_[k]];
  fill(b, k);
  if (++b.ready == b.params.size()) launch_in_order();
}

void GradSync::launch_in_order() {
  // Every rank launches buckets in the same order, whatever order they became
  // ready in, so the collectives match across ranks.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready == buckets_[next_launch_].params.size()) {
    Bucket& b = buckets_[next_launch_++];
    const Reduction& r = b.reductions.front();
    b.handle = all_reduce(*r.group, b.buffer, r.op, /*async=*/true);
  }
}

void GradSync::finish() {
  for (auto& b : buckets_) {
    if (b.ready == b.params.size()) continue;
    // Gradients that arrived while sync was off, or never.
    for (size_t k : b.params) fill(b, k);
    b.ready = b.params.size();
  }
  launch_in_order();
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b.handle.wait();
    for (size_t i = 1; i < b.reductions.size(); ++i) all_reduce(*b.reductions[i].group, b.buffer, b.reductions[i].op);
    const int64_t slot = b.buffer.numel() - static_cast<int64_t>(b.params.size());
    // The flags read on the host: a GPU's are copied over; a dry run's stay on meta.
    const c10::Device host = b.buffer.is_meta() ? c10::Device(c10::kMeta) : c10::Device(c10::kCPU);
    auto flags = b.buffer.narrow(0, slot, static_cast<int64_t>(b.params.size())).to(host, torch::kDouble).contiguous();
    for (size_t i = 0; i < b.params.size(); ++i) {
      auto& p = params_[b.params[i]];
      // No rank has a gradient (a dry run's meta flags have no values: it
      // takes the common case, a gradient somewhere).
      if (!flags.is_meta() && flags.data_ptr<double>()[i] <= 0) continue;
      auto synced = b.buffer.narrow(0, static_cast<int64_t>(offset_of_[b.params[i]]), p.numel()).view(p.sizes());
      // The gradient becomes its view of the bucket (DDP's gradient_as_bucket_view): no copy back. It
      // stays one until the next step drops every gradient; a gradient accumulated into it before
      // that is copied onto itself by fill().
      if (p.is_contiguous()) {
        p.mutable_grad() = synced;
      } else {
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        p.mutable_grad().copy_(synced);
      }
    }
    b.ready = 0;
  }
  next_launch_ = 0;
}

}  // namespace composer::parallel

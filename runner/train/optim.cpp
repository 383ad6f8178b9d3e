#include "runner/train/optim.h"

#include <cmath>
#include <map>
#include <unordered_map>

#include "models/select.h"
#include "runner/train/optim_kernels.h"

namespace composer {

torch::Tensor compute_loss(const LossConfig& loss, const torch::Tensor& output, const torch::Tensor& targets,
                           int64_t n, int64_t global, const parallel::VocabParallel& vocab, double loss_tokens) {
  // Reduced-precision outputs are promoted so the loss itself is float32.
  const bool reduced = output.scalar_type() == torch::kBFloat16 || output.scalar_type() == torch::kHalf;
  auto y = reduced ? output.to(torch::kFloat) : output;
  torch::Tensor l;
  bool mean_type = true;
  switch (loss.name) {
    case LossKind::kSum:
      l = y.sum();
      mean_type = false;
      break;
    case LossKind::kMean: l = y.mean(); break;
    case LossKind::kMse: l = torch::mse_loss(y, targets.to(y.scalar_type())); break;
    case LossKind::kCrossEntropy:
      if (loss_tokens > 0) {
        const auto logits = y.reshape({-1, y.size(-1)});
        l = (vocab.group ? parallel::vocab_parallel_cross_entropy(vocab, logits, targets.reshape({-1}), true)
                         : torch::nn::functional::cross_entropy(
                               logits, targets.reshape({-1}),
                               torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100))) /
            loss_tokens;
        mean_type = false;
        break;
      }
      l = vocab.group ? parallel::vocab_parallel_cross_entropy(vocab, y.reshape({-1, y.size(-1)}), targets.reshape({-1}))
                      : torch::cross_entropy_loss(y.reshape({-1, y.size(-1)}), targets.reshape({-1}));
      break;
    case LossKind::kSoftCrossEntropy:
      l = torch::cross_entropy_loss(y.reshape({-1, y.size(-1)}),
                                    targets.to(y.scalar_type()).reshape({-1, y.size(-1)}));
      break;
  }
  double w = mean_type ? static_cast<double>(n) / static_cast<double>(global) : 1.0;
  return l * (w * loss.scale);
}

void adam_step_fused_aten(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                          const std::vector<torch::Tensor>& exp_avgs, const std::vector<torch::Tensor>& exp_avg_sqs,
                          const std::vector<int64_t>& steps, double lr, double beta1, double beta2, double eps,
                          double weight_decay, bool decoupled) {
  if (params.empty()) return;
  // The kernel reads each parameter's step from a float32 tensor on its
  // device (torch.optim keeps one per parameter); parameters on the same step
  // share one.
  std::map<int64_t, torch::Tensor> by_step;
  std::vector<torch::Tensor> state_steps;
  for (int64_t s : steps) {
    auto& t = by_step[s];
    if (!t.defined()) t = torch::full({}, static_cast<double>(s), params.front().options().dtype(torch::kFloat));
    state_steps.push_back(t);
  }
  if (decoupled) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, state_steps, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, {}, state_steps, lr, beta1, beta2, weight_decay, eps,
                     /*amsgrad=*/false, /*maximize=*/false);
  }
}

namespace {

// A parameter the fused CPU kernels (runner/train/optim_kernels.h) update:
// float32 on the CPU, with its gradient and state tensors contiguous. On meta
// (the dry run, runner/estimate) the same parameters take the fused path too,
// which there only creates the state: the kernel needs no temporaries, where
// the single-tensor path allocates some.
bool fusable_on_cpu(const torch::Tensor& p, const torch::Tensor& grad) {
  const auto device = p.device().type();
  return (device == c10::DeviceType::CPU || device == c10::DeviceType::Meta) && grad.device() == p.device() &&
         p.scalar_type() == torch::kFloat && grad.scalar_type() == torch::kFloat && p.is_contiguous() &&
         grad.is_contiguous() && grad.numel() == p.numel();
}

// A state tensor the fused kernels can update in place (or none yet).
bool contiguous_or_absent(const std::map<std::string, torch::Tensor>& state, const std::string& name) {
  auto it = state.find(name);
  return it == state.end() || !it->second.defined() || it->second.is_contiguous();
}

// One parameter's arrays and scalars for the fused Adam kernel.
struct AdamWork {
  float *p, *g, *m, *v;
  int64_t n;
  kernels::AdamStep k;
};

// Runs the kernel over blocks of every parameter's elements, the blocks of
// all parameters spread over the intra-op threads, so that many small
// parameters share the threads as well as one large one.
void adam_in_blocks(const std::vector<AdamWork>& work) {
  constexpr int64_t kBlock = 16384;
  std::vector<std::pair<const AdamWork*, int64_t>> blocks;  // (parameter, first element)
  for (const AdamWork& w : work) {
    for (int64_t b = 0; b < w.n; b += kBlock) blocks.emplace_back(&w, b);
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const auto& [w, b] = blocks[i];
      kernels::adam(w->p + b, w->g + b, w->m + b, w->v + b, std::min(kBlock, w->n - b), w->k);
    }
  });
}

// Adam and AdamW computed as torch.optim computes them on the CPU (its
// single-tensor path): exp_avg moves by lerp, the bias corrections are taken
// in double, AdamW decays the parameter before the update. LibTorch's C++
// torch::optim::Adam moves exp_avg by mul and add, which rounds differently,
// so a model trained with it drifts from the same model trained in PyTorch.
class Adam : public Optimizer {
 public:
  Adam(std::vector<torch::Tensor> params, const torch::optim::AdamOptions& o, bool decoupled_weight_decay)
      : Optimizer(std::move(params), std::make_unique<torch::optim::AdamOptions>(o)),
        decoupled_(decoupled_weight_decay) {}

  std::vector<std::string> state_names(const std::string&, const torch::Tensor&) const override {
    return {"exp_avg", "exp_avg_sq"};
  }

 protected:
  // The two moments of `p` in its state, made on its first step: zeros in p's layout.
  struct Moments {
    torch::Tensor& exp_avg;
    torch::Tensor& exp_avg_sq;
  };
  static Moments moments(State& s, const torch::Tensor& p) {
    Moments m{s.tensors["exp_avg"], s.tensors["exp_avg_sq"]};
    if (!m.exp_avg.defined()) {
      m.exp_avg = torch::zeros_like(p, torch::MemoryFormat::Preserve);
      m.exp_avg_sq = torch::zeros_like(p, torch::MemoryFormat::Preserve);
    }
    return m;
  }

  void update(torch::Tensor& p, torch::Tensor grad, State& s, const torch::optim::OptimizerOptions& options) override {
    const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
    const double lr = o.lr(), beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    auto [exp_avg, exp_avg_sq] = moments(s, p);
    if (o.weight_decay() != 0) {
      if (decoupled_) {
        p.mul_(1 - lr * o.weight_decay());
      } else {
        grad = grad.add(p, o.weight_decay());
      }
    }
    exp_avg.lerp_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    const double step_size = lr / (1 - std::pow(beta1, s.step));
    const double bias_correction2_sqrt = std::pow(1 - std::pow(beta2, s.step), 0.5);
    auto denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps());
    p.addcdiv_(exp_avg, denom, -step_size);
  }

  // On a GPU, torch.optim's fused kernel (adam_step_fused_aten) for each list
  // of parameters of one device and dtype: one pass over each parameter, its
  // gradient and both moments, instead of the multi-tensor path's eight. On the
  // CPU, float32 parameters go through the fused kernel (update_fused): the
  // single-tensor arithmetic above in one pass, with a correctly rounded sqrt
  // (runner/train/optim_kernels.h); anything else takes update() above.
  void update_all(std::vector<Update>& updates, const torch::optim::OptimizerOptions& options) override {
    std::map<std::pair<std::string, c10::ScalarType>, std::vector<Update*>> lists;
    std::vector<Update*> fused;
    for (auto& u : updates) {
      const auto& t = u.state->tensors;
      if (fusable_on_cpu(u.param, u.grad) && contiguous_or_absent(t, "exp_avg") && contiguous_or_absent(t, "exp_avg_sq")) {
        fused.push_back(&u);
      } else if (u.param.is_cuda() && u.grad.device() == u.param.device() &&
                 u.grad.scalar_type() == u.param.scalar_type() && u.param.is_contiguous() &&
                 u.grad.is_contiguous() && contiguous_or_absent(t, "exp_avg") && contiguous_or_absent(t, "exp_avg_sq")) {
        lists[{u.param.device().str(), u.param.scalar_type()}].push_back(&u);
      } else {
        update(u.param, u.grad, *u.state, options);
      }
    }
    const auto& o = static_cast<const torch::optim::AdamOptions&>(options);
    if (!fused.empty()) update_fused(fused, o);
    for (auto& [key, list] : lists) update_list(list, o);
  }

  void update_fused(const std::vector<Update*>& list, const torch::optim::AdamOptions& o) {
    const double lr = o.lr(), beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas()), wd = o.weight_decay();
    const bool meta = list.front()->param.is_meta();
    std::vector<AdamWork> work;
    for (Update* u : list) {
      auto [exp_avg, exp_avg_sq] = moments(*u->state, u->param);
      if (meta) continue;  // a dry run has no values
      // The scalars as the single-tensor path passes them, in double, then
      // cast to float32 as ATen's float kernels do.
      kernels::AdamStep k;
      if (wd != 0) (decoupled_ ? k.decay : k.l2) = static_cast<float>(decoupled_ ? 1 - lr * wd : wd);
      k.lerp_weight = static_cast<float>(1 - beta1);
      k.beta2 = static_cast<float>(beta2);
      k.one_minus_beta2 = static_cast<float>(1 - beta2);
      k.bias_correction2_sqrt = static_cast<float>(std::pow(1 - std::pow(beta2, u->state->step), 0.5));
      k.eps = static_cast<float>(o.eps());
      k.neg_step_size = static_cast<float>(-(lr / (1 - std::pow(beta1, u->state->step))));
      work.push_back({u->param.data_ptr<float>(), u->grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                      exp_avg_sq.data_ptr<float>(), u->param.numel(), k});
    }
    adam_in_blocks(work);
  }

  void update_list(const std::vector<Update*>& list, const torch::optim::AdamOptions& o) {
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs;
    std::vector<int64_t> steps;
    for (Update* u : list) {
      auto [exp_avg, exp_avg_sq] = moments(*u->state, u->param);
      params.push_back(u->param);
      grads.push_back(u->grad);
      exp_avgs.push_back(exp_avg);
      exp_avg_sqs.push_back(exp_avg_sq);
      steps.push_back(u->state->step);
    }
    adam_step_fused_aten(params, grads, exp_avgs, exp_avg_sqs, steps, o.lr(), std::get<0>(o.betas()),
                         std::get<1>(o.betas()), o.eps(), o.weight_decay(), decoupled_);
  }

  bool decoupled_;
};

// torch.optim.Muon's options, one group's.
struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  double lr = 0;
  double weight_decay = 0;
  MuonConfig c;
  double get_lr() const override { return lr; }
  void set_lr(const double v) override { lr = v; }
};

// Muon for the matrices (the second group), AdamW for the rest (the first):
// torch.optim.Muon's single-tensor arithmetic for each matrix, each expert of
// a [experts, out, in] stack on its own, with the orthogonalisation of each
// whole matrix on its owner (parallelisms/whole_matrix.h).
class Muon : public Adam {
 public:
  Muon(std::vector<torch::Tensor> matrices, std::vector<torch::Tensor> rest, const MuonOptions& m,
       const torch::optim::AdamOptions& a, std::shared_ptr<const parallel::WholeMatrices> whole)
      : Adam(std::move(rest), a, /*decoupled_weight_decay=*/true), muon_(m.c), whole_(std::move(whole)) {
    add_param_group(torch::optim::OptimizerParamGroup(std::move(matrices), std::make_unique<MuonOptions>(m)));
  }

  std::vector<std::string> state_names(const std::string& name, const torch::Tensor& p) const override {
    if (muon_trains(muon_, name, whole_->global_shape(p))) return {"momentum_buffer"};
    return Adam::state_names(name, p);
  }

 private:
  void update_all(std::vector<Update>& updates, const torch::optim::OptimizerOptions& options) override {
    const auto* m = dynamic_cast<const MuonOptions*>(&options);
    if (!m) return Adam::update_all(updates, options);
    const MuonConfig& c = m->c;
    std::vector<torch::Tensor> params, locals;
    std::vector<int> batch_dims;
    for (auto& u : updates) {
      torch::Tensor& buf = u.state->tensors["momentum_buffer"];
      if (!buf.defined()) buf = torch::zeros_like(u.grad, torch::MemoryFormat::Preserve);
      buf.lerp_(u.grad, 1 - c.momentum);
      params.push_back(u.param);
      locals.push_back(c.nesterov ? u.grad.lerp(buf, c.momentum) : buf);
      batch_dims.push_back(muon_stack_dims(u.param.sizes().vec()));
    }
    const auto ortho = whole_->apply(params, locals, batch_dims, scalar_type_of(c.ns_dtype),
                                     [&](const torch::Tensor& whole) { return newton_schulz(whole, c); });
    for (size_t i = 0; i < updates.size(); ++i) {
      torch::Tensor& p = updates[i].param;
      const auto shape = whole_->global_shape(p);
      const double adjusted = m->lr * muon_lr_ratio(c.adjust_lr_fn, shape[shape.size() - 2], shape.back());
      p.mul_(1 - m->lr * m->weight_decay);
      p.add_(ortho[i], -adjusted);
    }
  }

  MuonConfig muon_;
  std::shared_ptr<const parallel::WholeMatrices> whole_;
};

// SGD as torch.optim's single-tensor path computes it: the momentum buffer
// starts as a copy of the first gradient.
class Sgd : public Optimizer {
 public:
  Sgd(std::vector<torch::Tensor> params, const torch::optim::SGDOptions& o)
      : Optimizer(std::move(params), std::make_unique<torch::optim::SGDOptions>(o)) {}

  std::vector<std::string> state_names(const std::string&, const torch::Tensor&) const override {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(defaults());
    return o.momentum() != 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }

 private:
  void update(torch::Tensor& p, torch::Tensor grad, State& s, const torch::optim::OptimizerOptions& options) override {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
    if (o.weight_decay() != 0) grad = grad.add(p, o.weight_decay());
    if (o.momentum() != 0) {
      auto& buf = s.tensors["momentum_buffer"];
      if (!buf.defined()) {
        buf = grad.clone().detach();
      } else {
        buf.mul_(o.momentum()).add_(grad, 1 - o.dampening());
      }
      grad = o.nesterov() ? grad.add(buf, o.momentum()) : buf;
    }
    p.add_(grad, -o.lr());
  }
};

}  // namespace

torch::Tensor newton_schulz(const torch::Tensor& u, const MuonConfig& c) {
  if (u.dim() == 3) {  // a stack of matrices, each on its own as torch.optim.Muon would see it
    std::vector<torch::Tensor> each;
    for (int64_t e = 0; e < u.size(0); ++e) each.push_back(newton_schulz(u[e], c));
    return each.empty() ? u.to(scalar_type_of(c.ns_dtype)) : torch::stack(each);
  }
  TORCH_INTERNAL_ASSERT(u.dim() == 2, "newton_schulz takes a matrix, got ", u.sizes());
  const double a = c.ns_coefficients.at(0), b = c.ns_coefficients.at(1), k = c.ns_coefficients.at(2);
  const bool tall = u.size(0) > u.size(1);
  torch::Tensor x = u.to(scalar_type_of(c.ns_dtype), /*non_blocking=*/false, /*copy=*/true);  // never u itself
  if (tall) x = x.t();
  x.div_(x.norm().clamp_min(c.eps));
  for (int64_t i = 0; i < c.ns_steps; ++i) {
    const torch::Tensor gram = x.mm(x.t());
    const torch::Tensor update = torch::addmm(gram, gram, gram, b, k);
    x = torch::addmm(x, update, x, a);
  }
  return tall ? x.t() : x;
}

double muon_lr_ratio(MuonAdjustLr fn, int64_t rows, int64_t cols) {
  const double r = static_cast<double>(rows), cl = static_cast<double>(cols);
  return fn == MuonAdjustLr::kMatchRmsAdamw ? 0.2 * std::sqrt(std::max(r, cl)) : std::sqrt(std::max(1.0, r / cl));
}

std::vector<std::string> names_in(torch::nn::Module& model, const std::vector<torch::Tensor>& params) {
  std::unordered_map<const c10::TensorImpl*, std::string> by_impl;
  for (auto& [name, p] : nn::unique_named_parameters(model)) by_impl.emplace(p.unsafeGetTensorImpl(), name);
  std::vector<std::string> out;
  for (const auto& p : params) {
    auto it = by_impl.find(p.unsafeGetTensorImpl());
    out.push_back(it == by_impl.end() ? std::string() : it->second);
  }
  return out;
}

int muon_stack_dims(const std::vector<int64_t>& shape) { return shape.size() == 3 ? 1 : 0; }

bool muon_trains(const MuonConfig& c, const std::string& name, const std::vector<int64_t>& global_shape) {
  return (global_shape.size() == 2 || global_shape.size() == 3) && !models::matches_any(c.exclude, name);
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& c, std::vector<torch::Tensor> params,
                                          const std::vector<std::string>& names,
                                          std::shared_ptr<const parallel::WholeMatrices> whole) {
  using torch::optim::AdamOptions;
  using torch::optim::SGDOptions;
  if (c.name == OptimizerKind::kMuon) {
    TORCH_INTERNAL_ASSERT(names.size() == params.size(), "muon needs every parameter's name");
    if (!whole) whole = std::make_shared<parallel::WholeMatrices>(nullptr);
    MuonOptions m;
    m.c = c.muon_or_default();
    m.lr = c.muon_lr();
    m.weight_decay = c.weight_decay;
    std::vector<torch::Tensor> matrices, rest;
    for (size_t i = 0; i < params.size(); ++i) {
      (muon_trains(m.c, names[i], whole->global_shape(params[i])) ? matrices : rest).push_back(params[i]);
    }
    return std::make_unique<Muon>(
        matrices, rest, m,
        AdamOptions(c.lr).betas(std::make_tuple(c.betas[0], c.betas[1])).eps(c.eps).weight_decay(c.weight_decay),
        whole);
  }
  switch (c.name) {
    case OptimizerKind::kSgd:
      return std::make_unique<Sgd>(params, SGDOptions(c.lr)
                                               .momentum(c.momentum)
                                               .dampening(c.dampening)
                                               .nesterov(c.nesterov)
                                               .weight_decay(c.weight_decay));
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return std::make_unique<Adam>(
          params, AdamOptions(c.lr).betas(std::make_tuple(c.betas[0], c.betas[1])).eps(c.eps).weight_decay(c.weight_decay),
          c.name == OptimizerKind::kAdamW);
    case OptimizerKind::kMuon: break;  // above
  }
  return nullptr;
}

double lr_at(const OptimizerConfig& opt, const LrScheduleConfig& s, int64_t step, int64_t steps) {
  const double lr = opt.lr;
  if (step <= s.warmup_steps) return lr * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  if (s.decay == Decay::kNone) return lr;
  const double span = static_cast<double>(std::max<int64_t>(1, steps - s.warmup_steps));
  const double progress = static_cast<double>(step - s.warmup_steps - 1) / span;
  if (s.decay == Decay::kLinear) return lr + (s.min_lr - lr) * progress;
  return s.min_lr + (lr - s.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

double grad_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> norms;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    auto g = p.grad().detach();
    norms.push_back((g.scalar_type() == torch::kDouble ? g : g.to(torch::kFloat)).norm(2));
  }
  if (norms.empty()) return 0.0;
  auto norm = torch::stack(norms).norm(2);
  return norm.is_meta() ? 0.0 : norm.item<double>();  // a dry run's tensors have no values
}

void clip_grads(const std::vector<torch::Tensor>& params, double norm, double max_norm) {
  const double coef = std::min(1.0, max_norm / (norm + 1e-6));
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.mutable_grad().mul_(coef);
  }
}

}  // namespace composer

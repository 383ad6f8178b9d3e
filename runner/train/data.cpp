#include "runner/train/data.h"

#include <chrono>
#include <future>

namespace composer {

SourceRef data_ref(const ExperimentConfig& c, const std::string& key) {
  return SourceRef{c.file, 0, 0, "data." + key, ""};
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

TargetKind default_targets(LossKind loss, bool tokens) {
  switch (loss) {
    case LossKind::kSum:
    case LossKind::kMean: return TargetKind::kNone;
    case LossKind::kMse: return TargetKind::kNormal;
    case LossKind::kCrossEntropy: return tokens ? TargetKind::kNextTokens : TargetKind::kTokens;
    case LossKind::kSoftCrossEntropy: return TargetKind::kUniform;
  }
  return TargetKind::kNone;
}

void check_targets(const ExperimentConfig& c, const DataPlan& p) {
  LossKind loss = c.train.loss.name;
  bool ids = p.targets == TargetKind::kTokens || p.targets == TargetKind::kNextTokens;
  bool floats = p.targets == TargetKind::kNormal || p.targets == TargetKind::kUniform;
  std::string name = name_of(loss);
  if ((loss == LossKind::kSum || loss == LossKind::kMean) && p.targets != TargetKind::kNone) {
    throw ConfigError(data_ref(c, "targets"), "loss " + name + " uses no targets; set data.targets: none or auto");
  }
  if (loss == LossKind::kCrossEntropy && !ids) {
    throw ConfigError(data_ref(c, "targets"), "loss cross_entropy needs class ids; set data.targets: tokens or next_tokens");
  }
  if ((loss == LossKind::kMse || loss == LossKind::kSoftCrossEntropy) && !floats) {
    throw ConfigError(data_ref(c, "targets"), "loss " + name + " needs float targets; set data.targets: normal or uniform");
  }
  if (p.targets == TargetKind::kNextTokens && p.inputs != InputKind::kTokens) {
    throw ConfigError(data_ref(c, "targets"), "next_tokens targets need token inputs");
  }
}

}  // namespace

uint64_t token_window(uint64_t seed, int64_t global_index, int64_t positions) {
  const uint64_t h = splitmix64(splitmix64(seed ^ 0x746f6b656e73ull) ^ static_cast<uint64_t>(global_index));
  return h % static_cast<uint64_t>(positions);
}

size_t blend_source(uint64_t seed, int64_t global_index, const std::vector<double>& cumulative) {
  const uint64_t h = splitmix64(splitmix64(seed ^ 0x626c656e64ull) ^ static_cast<uint64_t>(global_index));
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;
  const double total = cumulative.back();
  for (size_t i = 0; i < cumulative.size(); ++i) {
    if (u < cumulative[i] / total) return i;
  }
  return cumulative.size() - 1;
}

void doc_start_by_eos(const int64_t* window, int64_t len, int64_t eos_id, int64_t* out) {
  for (int64_t k = 0; k < len; ++k) out[k] = k == 0 ? 0 : (window[k - 1] == eos_id ? k : out[k - 1]);
}

uint64_t sample_seed(uint64_t seed, int64_t step, int64_t index) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(step));
  h = splitmix64(h ^ static_cast<uint64_t>(index));
  return h & 0x7fffffffffffffffull;
}

DataPlan plan_data(const ExperimentConfig& c, models::Model& model) {
  DataPlan p;
  p.input = model.input_spec();
  p.dtype = scalar_type_of(c.train.dtype);
  p.inputs = c.data.inputs == InputKind::kAuto ? (p.input.tokens ? InputKind::kTokens : InputKind::kNormal)
                                               : c.data.inputs;
  if ((p.inputs == InputKind::kTokens) != p.input.tokens) {
    throw ConfigError(data_ref(c, "inputs"), std::string("model ") + c.model.name + " takes " +
                                                 (p.input.tokens ? "token ids; use inputs: tokens or auto"
                                                                 : "float features; use inputs: normal, uniform or auto"));
  }
  p.seq_len = c.data.seq_len ? c.data.seq_len : p.input.max_seq_len;
  if (p.input.tokens && p.seq_len > p.input.max_seq_len) {
    throw ConfigError(data_ref(c, "seq_len"), "seq_len " + std::to_string(p.seq_len) +
                                                  " exceeds the model's max_seq_len " +
                                                  std::to_string(p.input.max_seq_len));
  }
  p.documents = c.data.documents.active();
  p.targets = c.data.targets == TargetKind::kAuto ? default_targets(c.train.loss.name, p.input.tokens)
                                                  : c.data.targets;
  check_targets(c, p);
  torch::NoGradGuard no_grad;
  // On the parameters' device: a shape-only (meta) model gets a meta probe.
  const auto params = model.parameters();
  const auto device = params.empty() ? torch::Device(torch::kCPU) : params.front().device();
  auto probe = p.input.tokens ? torch::zeros({1, p.seq_len}, torch::dtype(torch::kLong).device(device))
                              : torch::zeros({1, p.input.features}, torch::dtype(p.dtype).device(device));
  // In eval mode: a probe must not move running statistics (BatchNorm's).
  const bool training = model.is_training();
  model.eval();
  auto out = model(probe);
  model.train(training);
  p.output_shape = out.sizes().slice(1).vec();
  return p;
}

// The read in flight: its step and result.
struct Prefetcher::Ahead {
  int64_t step = 0;
  std::future<Batch> batch;
};

Prefetcher::Prefetcher(const DataSet& data, int64_t begin, int64_t end, int64_t last_step)
    : data_(data), begin_(begin), end_(end), last_step_(last_step) {}

Prefetcher::~Prefetcher() {
  if (ahead_ && ahead_->batch.valid()) ahead_->batch.wait();  // its error, if any, dies with it
}

Batch Prefetcher::batch(int64_t step, int64_t begin, int64_t end) {
  const auto t0 = std::chrono::steady_clock::now();
  Batch out;
  if (begin < begin_ || end > end_ || !data_.reads_ahead()) {
    out = data_.batch(step, begin, end);
  } else {
    if (current_step_ != step) {
      if (ahead_ && ahead_->step == step) {
        current_ = ahead_->batch.get();  // rethrows the read's error here
      } else {
        if (ahead_ && ahead_->batch.valid()) ahead_->batch.wait();
        current_ = data_.batch(step, begin_, end_);
      }
      ahead_.reset();
      current_step_ = step;
      if (step < last_step_) {
        ahead_ = std::make_unique<Ahead>();
        ahead_->step = step + 1;
        const DataSet* data = &data_;
        const int64_t b = begin_, e = end_;
        ahead_->batch = std::async(std::launch::async, [data, step, b, e] { return data->batch(step + 1, b, e); });
      }
    }
    auto part = [&](const torch::Tensor& t) {
      return t.defined() && t.dim() > 0 ? t.narrow(0, begin - begin_, end - begin) : t;
    };
    out = {part(current_.inputs), part(current_.targets), part(current_.doc_start), current_.loss_tokens};
  }
  wait_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

double Prefetcher::take_wait_ms() {
  const double w = wait_ms_;
  wait_ms_ = 0;
  return w;
}

}  // namespace composer

#include "runner/train/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "runner/base/safetensors.h"

namespace composer {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

SourceRef data_ref(const ExperimentConfig& c, const std::string& key) {
  return SourceRef{c.file, 0, 0, "data." + key, ""};
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

class SyntheticData : public DataSet {
 public:
  SyntheticData(uint64_t seed, DataPlan plan) : seed_(seed), p_(std::move(plan)) {}

  Batch batch(int64_t step, int64_t begin, int64_t end) const override {
    std::vector<torch::Tensor> xs, ys;
    for (int64_t i = begin; i < end; ++i) {
      auto [x, y] = sample(step, i);
      xs.push_back(x);
      if (y.defined()) ys.push_back(y);
    }
    Batch b{torch::stack(xs), ys.empty() ? torch::Tensor() : torch::stack(ys)};
    return b;
  }

 private:
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t step, int64_t index) const {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(sample_seed(seed_, step, index));
    const auto& out = p_.output_shape;
    if (p_.targets == TargetKind::kNextTokens) {
      auto seq = torch::randint(0, p_.input.vocab_size, {p_.seq_len + 1}, gen);
      return {seq.slice(0, 0, p_.seq_len), seq.slice(0, 1, p_.seq_len + 1)};
    }
    torch::Tensor x, y;
    switch (p_.inputs) {
      case InputKind::kTokens: x = torch::randint(0, p_.input.vocab_size, {p_.seq_len}, gen); break;
      case InputKind::kUniform: x = torch::rand({p_.input.features}, gen).to(p_.dtype); break;
      default: x = torch::randn({p_.input.features}, gen).to(p_.dtype); break;
    }
    switch (p_.targets) {
      case TargetKind::kNormal: y = torch::randn(out, gen); break;
      case TargetKind::kUniform: y = torch::rand(out, gen); break;
      case TargetKind::kTokens:
        y = torch::randint(0, out.back(), std::vector<int64_t>(out.begin(), out.end() - 1), gen);
        break;
      default: break;
    }
    return {x, y};
  }

  uint64_t seed_;
  DataPlan p_;
};

class FileData : public DataSet {
 public:
  FileData(const ExperimentConfig& c, const DataPlan& p) : global_batch_(c.train.global_batch) {
    for (auto& [name, t] : read_safetensors(c.data.path)) {
      if (name == "inputs") inputs_ = t;
      else if (name == "targets") targets_ = t;
    }
    const std::string& path = c.data.path;
    if (!inputs_.defined() || inputs_.dim() < 1 || inputs_.size(0) == 0) {
      throw FileError(path, "needs a tensor named 'inputs' with samples on dim 0");
    }
    std::vector<int64_t> want = p.inputs == InputKind::kTokens ? std::vector<int64_t>{p.seq_len}
                                                                : std::vector<int64_t>{p.input.features};
    if (inputs_.sizes().slice(1).vec() != want) {
      throw FileError(path, "'inputs' samples have shape " + c10::str(inputs_.sizes().slice(1)) +
                                " but the model takes " + c10::str(c10::IntArrayRef(want)));
    }
    if (p.inputs == InputKind::kTokens) {
      if (inputs_.scalar_type() != torch::kLong) throw FileError(path, "token 'inputs' must be I64");
    } else {
      inputs_ = inputs_.to(p.dtype);
    }
    if (p.targets == TargetKind::kNone) return;
    if (!targets_.defined() || targets_.dim() < 1 || targets_.size(0) != inputs_.size(0)) {
      throw FileError(path, "needs a tensor named 'targets' with as many samples as 'inputs'");
    }
    bool ids = p.targets == TargetKind::kTokens || p.targets == TargetKind::kNextTokens;
    if (ids && targets_.scalar_type() != torch::kLong) throw FileError(path, "class-id 'targets' must be I64");
    if (!ids) targets_ = targets_.to(torch::kFloat);
  }

  Batch batch(int64_t step, int64_t begin, int64_t end) const override {
    const int64_t n = inputs_.size(0);
    auto idx = (torch::arange(begin, end, torch::kLong) + (step - 1) * global_batch_).remainder(n);
    return {inputs_.index_select(0, idx), targets_.defined() ? targets_.index_select(0, idx) : torch::Tensor()};
  }

 private:
  int64_t global_batch_;
  torch::Tensor inputs_, targets_;
};

// A flat file of little-endian token ids (nanoGPT and Megatron write them),
// memory-mapped. Sample g of the run (g = (step - 1) * global_batch + index)
// is the window of seq_len + 1 tokens at token_window(seed, g, ...): the
// inputs are its first seq_len tokens, the next-token targets its last.
class TokenFileData : public DataSet {
 public:
  TokenFileData(const ExperimentConfig& c, const DataPlan& p)
      : path_(c.data.path), path_ref_(data_ref(c, "path")), seed_(c.seed), global_batch_(c.train.global_batch), seq_len_(p.seq_len),
        vocab_(p.input.vocab_size), width_(c.data.token_dtype == TokenDType::kUint32 ? 4 : 2) {
    if (p.inputs != InputKind::kTokens) {
      throw ConfigError(data_ref(c, "source"), "data.source tokens feeds token models; model " + c.model.name +
                                                   " takes float features");
    }
    if (p.targets != TargetKind::kNextTokens && p.targets != TargetKind::kNone) {
      throw ConfigError(data_ref(c, "targets"), "a token file gives next_tokens targets (or none); set data.targets: "
                                                "next_tokens or auto");
    }
    next_tokens_ = p.targets == TargetKind::kNextTokens;
    const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw FileError(path_, std::string("cannot open the token file: ") + std::strerror(errno));
    struct stat st {};
    fstat(fd, &st);
    bytes_ = static_cast<size_t>(st.st_size);
    if (bytes_ % width_ != 0) {
      close(fd);
      throw FileError(path_, "is " + std::to_string(bytes_) + " bytes, not a whole number of " +
                                 name_of(c.data.token_dtype) + " ids; check data.token_dtype");
    }
    tokens_ = static_cast<int64_t>(bytes_ / width_);
    if (tokens_ < seq_len_ + 1) {
      close(fd);
      throw FileError(path_, "holds " + std::to_string(tokens_) + " tokens, fewer than one sample's seq_len + 1 = " +
                                 std::to_string(seq_len_ + 1));
    }
    map_ = mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map_ == MAP_FAILED) throw FileError(path_, std::string("cannot map the token file: ") + std::strerror(errno));
  }
  ~TokenFileData() override { munmap(map_, bytes_); }

  void check_all() const override {
    int64_t largest = -1, at = 0;
    for (int64_t i = 0; i < tokens_; ++i) {
      const int64_t id = token(i);
      if (id > largest) {
        largest = id;
        at = i;
      }
    }
    if (largest >= vocab_) {
      throw ConfigError(path_ref_, path_ + ": its largest token id is " + std::to_string(largest) + " (token " +
                                       std::to_string(at) + "), not below the model's vocab_size " +
                                       std::to_string(vocab_) + "; prepare the data with the model's tokenizer "
                                       "(tools/prepare-data) or raise model.args.vocab_size above " +
                                       std::to_string(largest));
    }
  }
  TokenFileData(const TokenFileData&) = delete;
  TokenFileData& operator=(const TokenFileData&) = delete;

  Batch batch(int64_t step, int64_t begin, int64_t end) const override {
    const int64_t n = end - begin, span = seq_len_ + 1;
    auto window = torch::empty({n, span}, torch::kLong);
    auto* out = window.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = (step - 1) * global_batch_ + begin + i;
      const int64_t start = static_cast<int64_t>(token_window(seed_, g, tokens_ - span + 1));
      for (int64_t k = 0; k < span; ++k) {
        const int64_t id = token(start + k);
        if (id >= vocab_) {
          throw FileError(path_, "token " + std::to_string(start + k) + " is " + std::to_string(id) +
                                     ", outside the model's vocab_size " + std::to_string(vocab_));
        }
        out[i * span + k] = id;
      }
    }
    if (!next_tokens_) return {window.slice(1, 0, seq_len_).contiguous(), torch::Tensor()};
    return {window.slice(1, 0, seq_len_).contiguous(), window.slice(1, 1, span).contiguous()};
  }

 private:
  int64_t token(int64_t i) const {
    const auto* b = static_cast<const uint8_t*>(map_) + i * width_;
    uint32_t v = 0;
    for (int k = width_ - 1; k >= 0; --k) v = (v << 8) | b[k];  // little-endian
    return v;
  }

  std::string path_;
  SourceRef path_ref_;
  uint64_t seed_;
  int64_t global_batch_, seq_len_, vocab_;
  int width_;
  bool next_tokens_ = true;
  size_t bytes_ = 0;
  int64_t tokens_ = 0;
  void* map_ = nullptr;
};

}  // namespace

uint64_t token_window(uint64_t seed, int64_t global_index, int64_t positions) {
  const uint64_t h = splitmix64(splitmix64(seed ^ 0x746f6b656e73ull) ^ static_cast<uint64_t>(global_index));
  return h % static_cast<uint64_t>(positions);
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

std::unique_ptr<DataSet> make_dataset(const ExperimentConfig& c, const DataPlan& plan) {
  if (c.data.source == DataSource::kFile) {
    return naming_config_key(c.data.path_ref, [&] { return std::make_unique<FileData>(c, plan); });
  }
  if (c.data.source == DataSource::kTokens) {
    return naming_config_key(c.data.path_ref,
                             [&]() -> std::unique_ptr<DataSet> { return std::make_unique<TokenFileData>(c, plan); });
  }
  return std::make_unique<SyntheticData>(c.seed, plan);
}

}  // namespace composer

#include "runner/train/datasets.h"

#include <ATen/CPUGeneratorImpl.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <mutex>
#include <sstream>

#include "runner/base/safetensors.h"

namespace composer {
namespace {

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
// memory-mapped; with `index`, also its document index: the little-endian
// uint64 end offset (exclusive, in tokens) of each document, as
// tools/prepare-data writes it to <path>.docs; with `mask`, its loss mask:
// one byte per token, 1 where the token is trained as a target (<path>.mask,
// tools/prepare-data --chat).
class TokenFile {
 public:
  TokenFile(const std::string& path, int width, int64_t min_tokens, bool index, bool mask = false)
      : path_(path), width_(width) {
    map_ = map(path_, bytes_);
    try {  // a constructor that throws runs no destructor: the mapping is released here
      if (bytes_ % width_ != 0) {
        throw FileError(path_, "is " + std::to_string(bytes_) + " bytes, not a whole number of " +
                                   (width_ == 2 ? "uint16" : "uint32") + " ids; check data.token_dtype");
      }
      tokens_ = static_cast<int64_t>(bytes_ / width_);
      if (tokens_ < min_tokens) {
        throw FileError(path_, "holds " + std::to_string(tokens_) + " tokens, fewer than one sample's seq_len + 1 = " +
                                   std::to_string(min_tokens));
      }
      if (index) read_index();
      if (mask) read_mask();
    } catch (...) {
      if (map_) munmap(map_, bytes_);
      throw;
    }
  }
  ~TokenFile() {
    if (map_) munmap(map_, bytes_);
  }
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  int64_t size() const { return tokens_; }
  const std::string& path() const { return path_; }
  int64_t token(int64_t i) const {
    const auto* b = static_cast<const uint8_t*>(map_) + i * width_;
    uint32_t v = 0;
    for (int k = width_ - 1; k >= 0; --k) v = (v << 8) | b[k];  // little-endian
    return v;
  }
  // Whether token i is trained as a target (always without a loss mask).
  bool trained(int64_t i) const { return mask_.empty() || mask_[static_cast<size_t>(i)] != 0; }
  const std::vector<uint64_t>& ends() const { return ends_; }
  const std::vector<uint8_t>& mask() const { return mask_; }
  // doc_start of the `len` tokens from `start` by the index: where, counted
  // from `start`, the document of each begins (0 for the first's).
  void doc_start(int64_t start, int64_t len, int64_t* out) const {
    // The first document that ends after `start`: the one `start` is in.
    size_t d = std::upper_bound(ends_.begin(), ends_.end(), static_cast<uint64_t>(start)) - ends_.begin();
    int64_t begins = 0;
    for (int64_t k = 0; k < len; ++k) {
      while (d < ends_.size() && static_cast<int64_t>(ends_[d]) <= start + k) {
        begins = static_cast<int64_t>(ends_[d]) - start;
        ++d;
      }
      out[k] = begins;
    }
  }

 private:
  static void* map(const std::string& path, size_t& bytes) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw FileError(path, std::string("cannot open the token file: ") + std::strerror(errno));
    struct stat st {};
    fstat(fd, &st);
    bytes = static_cast<size_t>(st.st_size);
    void* m = bytes ? mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
    close(fd);
    if (m == MAP_FAILED) throw FileError(path, std::string("cannot map the file: ") + std::strerror(errno));
    return m;
  }
  void read_mask() {
    const std::string file = path_ + ".mask";
    std::FILE* f = std::fopen(file.c_str(), "rb");
    if (!f) {
      throw FileError(file, "no loss mask beside " + path_ + " (" + std::strerror(errno) +
                                "); write it with tools/prepare-data --chat, or remove data.loss_mask");
    }
    std::fseek(f, 0, SEEK_END);
    const long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    mask_.resize(static_cast<size_t>(std::max(n, 0L)));
    const size_t got = mask_.empty() ? 0 : std::fread(mask_.data(), 1, mask_.size(), f);
    std::fclose(f);
    if (n != tokens_ || got != mask_.size()) {
      throw FileError(file, "is " + std::to_string(n) + " bytes, not one per token of " + path_ + "'s " +
                                std::to_string(tokens_) + "; write the token file and its mask again with "
                                "tools/prepare-data --chat");
    }
    for (size_t i = 0; i < mask_.size(); ++i) {
      if (mask_[i] > 1) {
        throw FileError(file, "byte " + std::to_string(i) + " is " + std::to_string(mask_[i]) +
                                  ", not 0 (no loss) or 1 (trained); write it again with tools/prepare-data --chat");
      }
    }
  }
  void read_index() {
    const std::string index = path_ + ".docs";
    std::FILE* f = std::fopen(index.c_str(), "rb");
    if (!f) {
      throw FileError(index, "no document index beside " + path_ + " (" + std::strerror(errno) +
                                 "); write it with tools/prepare-data, or set data.documents.eos_id to the id that "
                                 "ends every document");
    }
    std::fseek(f, 0, SEEK_END);
    const long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    ends_.resize(static_cast<size_t>(n) / 8);
    const size_t got = ends_.empty() ? 0 : std::fread(ends_.data(), 8, ends_.size(), f);
    std::fclose(f);
    // Little-endian on disk; this machine's order is checked once.
    const uint16_t one = 1;
    if (*reinterpret_cast<const uint8_t*>(&one) != 1) {
      for (auto& e : ends_) e = __builtin_bswap64(e);
    }
    if (n % 8 != 0 || got != ends_.size() || ends_.empty()) {
      throw FileError(index, "is " + std::to_string(n) + " bytes, not a whole non-empty list of uint64 document ends");
    }
    for (size_t i = 0; i < ends_.size(); ++i) {
      if (ends_[i] == 0 || (i && ends_[i] <= ends_[i - 1]) || ends_[i] > static_cast<uint64_t>(tokens_)) {
        throw FileError(index, "document " + std::to_string(i) + " ends at token " + std::to_string(ends_[i]) +
                                   ", not after the one before and within the file's " + std::to_string(tokens_) +
                                   " tokens; write the token file and its index again with tools/prepare-data");
      }
    }
  }

  std::string path_;
  int width_;
  size_t bytes_ = 0;
  int64_t tokens_ = 0;
  void* map_ = nullptr;
  std::vector<uint64_t> ends_;
  std::vector<uint8_t> mask_;
};

// Sample g of the run (g = (step - 1) * global_batch + index) is a window of
// seq_len + 1 tokens of one file: of the blend's file blend_source(seed, g,
// ...) (the only one without a blend), at token_window(seed, g, ...). The
// inputs are its first seq_len tokens, the next-token targets its last.
// With packed documents each sample also gets its doc_start row, and without
// loss_on_boundary a target that starts a new document is -100 (ignored); with
// data.loss_mask so is a target its file's mask leaves out. The loss then
// divides by the global batch's count of the targets kept (loss_tokens).
class TokenFileData : public DataSet {
 public:
  TokenFileData(const ExperimentConfig& c, const DataPlan& p)
      : path_ref_(data_ref(c, c.data.sources.empty() ? "path" : "sources")), seed_(c.seed),
        global_batch_(c.train.global_batch), seq_len_(p.seq_len), vocab_(p.input.vocab_size),
        docs_(c.data.documents), loss_mask_(c.data.loss_mask) {
    if (p.inputs != InputKind::kTokens) {
      throw ConfigError(data_ref(c, "source"), "data.source tokens feeds token models; model " + c.model.name +
                                                   " takes float features");
    }
    if (p.targets != TargetKind::kNextTokens && p.targets != TargetKind::kNone) {
      throw ConfigError(data_ref(c, "targets"), "a token file gives next_tokens targets (or none); set data.targets: "
                                                "next_tokens or auto");
    }
    next_tokens_ = p.targets == TargetKind::kNextTokens;
    const int width = c.data.token_dtype == TokenDType::kUint32 ? 4 : 2;
    const bool index = docs_.active() && docs_.eos_id < 0;
    std::vector<TokenSource> sources = c.data.sources;
    if (sources.empty()) sources.push_back({c.data.path, 1.0, c.data.path_ref});
    double sum = 0;
    for (const auto& s : sources) {
      files_.push_back(naming_config_key(s.ref, [&] { return std::make_unique<TokenFile>(s.path, width, seq_len_ + 1, index, loss_mask_); }));
      weights_.push_back(s.weight);
      cumulative_.push_back(sum += s.weight);
    }
  }

  void check_all() const override {
    for (const auto& f : files_) {
      int64_t largest = -1, at = 0;
      for (int64_t i = 0; i < f->size(); ++i) {
        const int64_t id = f->token(i);
        if (id > largest) {
          largest = id;
          at = i;
        }
      }
      if (largest >= vocab_) {
        throw ConfigError(path_ref_, f->path() + ": its largest token id is " + std::to_string(largest) +
                                         " (token " + std::to_string(at) + "), not below the model's vocab_size " +
                                         std::to_string(vocab_) + "; prepare the data with the model's tokenizer "
                                         "(tools/prepare-data) or raise model.args.vocab_size above " +
                                         std::to_string(largest));
      }
    }
  }

  std::string describe(int64_t first, int64_t last) const override {
    if (files_.size() < 2 || last < first) return "";
    std::vector<int64_t> counts(files_.size(), 0);
    for (int64_t g = (first - 1) * global_batch_; g < last * global_batch_; ++g) ++counts[source_of(g)];
    const int64_t total = (last - first + 1) * global_batch_;
    std::ostringstream out;
    out << "data.sources: samples per source over steps " << first << "-" << last << " (" << total << "):";
    for (size_t i = 0; i < files_.size(); ++i) {
      out << (i ? ", " : " ") << files_[i]->path() << " " << counts[i] << " (" << std::fixed << std::setprecision(1)
          << 100.0 * counts[i] / total << "%, weight " << std::setprecision(3) << weights_[i] / cumulative_.back()
          << ")";
    }
    return out.str();
  }

  // The doc_start row of the span of `f` from `start` whose ids are `window`:
  // by the end-of-document id, or by the file's index.
  void starts_of(const TokenFile& f, int64_t start, const int64_t* window, int64_t* row) const {
    if (docs_.eos_id >= 0) {
      doc_start_by_eos(window, seq_len_ + 1, docs_.eos_id, row);
    } else {
      f.doc_start(start, seq_len_ + 1, row);
    }
  }

  // Sample g's window start in its file and (packed documents) its doc_start row over the whole span.
  int64_t window_of(int64_t g, std::vector<int64_t>* starts) const {
    const TokenFile& f = *files_[source_of(g)];
    const int64_t span = seq_len_ + 1, start = static_cast<int64_t>(token_window(seed_, g, f.size() - span + 1));
    if (!starts) return start;
    starts->resize(span);
    std::vector<int64_t> window(span);
    for (int64_t k = 0; k < span && docs_.eos_id >= 0; ++k) window[k] = f.token(start + k);
    starts_of(f, start, window.data(), starts->data());
    return start;
  }

  // Whether the loss drops some targets: document boundaries without loss_on_boundary, or a loss mask.
  bool drops_targets() const { return (docs_.active() && !docs_.loss_on_boundary) || loss_mask_; }

  // The targets of `step`'s global batch that are kept (drops_targets): the loss's divisor, at
  // least 1 (a step whose targets are all dropped has loss 0). Kept for the last step asked (the
  // loader's thread and this one ask).
  double loss_tokens(int64_t step) const {
    std::lock_guard<std::mutex> lock(counted_mutex_);
    if (counted_step_ == step) return counted_;
    int64_t n = 0;
    std::vector<int64_t> starts;
    const bool boundaries = docs_.active() && !docs_.loss_on_boundary;
    for (int64_t g = (step - 1) * global_batch_; g < step * global_batch_; ++g) {
      const TokenFile& f = *files_[source_of(g)];
      const int64_t start = window_of(g, boundaries ? &starts : nullptr);
      for (int64_t k = 1; k <= seq_len_; ++k) n += (boundaries && starts[k] == k) || !f.trained(start + k) ? 0 : 1;
    }
    counted_step_ = step;
    counted_ = static_cast<double>(std::max<int64_t>(n, 1));
    return counted_;
  }

  bool reads_ahead() const override { return true; }

  nlohmann::json where(int64_t g) const override {
    const size_t i = source_of(g);
    const TokenFile& f = *files_[i];
    std::vector<int64_t> starts;
    const int64_t start = window_of(g, docs_.active() ? &starts : nullptr);
    nlohmann::json out = {{"index", g}, {"source", i}, {"path", f.path()}, {"start", start}};
    if (docs_.active()) {  // the documents the inputs meet
      int64_t documents = 0;
      for (int64_t k = 0; k < seq_len_; ++k) documents += starts[k] == k ? 1 : 0;
      out["documents"] = documents;
    }
    return out;
  }

  Batch batch(int64_t step, int64_t begin, int64_t end) const override {
    const int64_t n = end - begin, span = seq_len_ + 1;
    auto window = torch::empty({n, span}, torch::kLong);
    auto* out = window.data_ptr<int64_t>();
    torch::Tensor starts, dropped;
    if (docs_.active()) starts = torch::empty({n, span}, torch::kLong);
    if (loss_mask_) dropped = torch::zeros({n, seq_len_}, torch::kBool);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = (step - 1) * global_batch_ + begin + i;
      const TokenFile& f = *files_[source_of(g)];
      const int64_t start = static_cast<int64_t>(token_window(seed_, g, f.size() - span + 1));
      for (int64_t k = 0; k < span; ++k) {
        const int64_t id = f.token(start + k);
        if (id >= vocab_) {
          throw FileError(f.path(), "token " + std::to_string(start + k) + " is " + std::to_string(id) +
                                        ", outside the model's vocab_size " + std::to_string(vocab_));
        }
        out[i * span + k] = id;
      }
      if (starts.defined()) starts_of(f, start, out + i * span, starts.data_ptr<int64_t>() + i * span);
      if (dropped.defined()) {  // target k is token start + k + 1
        auto* row = dropped.data_ptr<bool>() + i * seq_len_;
        for (int64_t k = 0; k < seq_len_; ++k) row[k] = !f.trained(start + k + 1);
      }
    }
    Batch b;
    b.inputs = window.slice(1, 0, seq_len_).contiguous();
    if (next_tokens_) b.targets = window.slice(1, 1, span).contiguous();
    if (starts.defined()) b.doc_start = starts.slice(1, 0, seq_len_).contiguous();
    if (b.targets.defined() && drops_targets()) {
      if (starts.defined() && !docs_.loss_on_boundary) {
        // Target k is token k + 1: a boundary's when that token begins its document.
        auto next = starts.slice(1, 1, span);
        b.targets.masked_fill_(next == torch::arange(1, span, torch::kLong).unsqueeze(0), -100);
      }
      if (dropped.defined()) b.targets.masked_fill_(dropped, -100);
      b.loss_tokens = loss_tokens(step);
    }
    return b;
  }

 private:
  size_t source_of(int64_t g) const { return files_.size() == 1 ? 0 : blend_source(seed_, g, cumulative_); }

  SourceRef path_ref_;
  uint64_t seed_;
  int64_t global_batch_, seq_len_, vocab_;
  DocumentsConfig docs_;
  bool loss_mask_;
  bool next_tokens_ = true;
  std::vector<std::unique_ptr<TokenFile>> files_;
  std::vector<double> weights_, cumulative_;
  mutable std::mutex counted_mutex_;
  mutable int64_t counted_step_ = 0;
  mutable double counted_ = 0;
};

}  // namespace

std::unique_ptr<DataSet> make_dataset(const ExperimentConfig& c, const DataPlan& plan) {
  if (c.data.source == DataSource::kFile) {
    return naming_config_key(c.data.path_ref, [&] { return std::make_unique<FileData>(c, plan); });
  }
  if (c.data.source == DataSource::kTokens) {
    return std::make_unique<TokenFileData>(c, plan);  // names each file's key itself
  }
  return std::make_unique<SyntheticData>(c.seed, plan);
}

Documents read_documents(const std::string& path, TokenDType dtype) {
  const bool mask = std::ifstream(path + ".mask").good();
  const TokenFile f(path, dtype == TokenDType::kUint32 ? 4 : 2, 1, /*index=*/true, mask);
  Documents d;
  d.tokens.resize(static_cast<size_t>(f.size()));
  for (int64_t i = 0; i < f.size(); ++i) d.tokens[static_cast<size_t>(i)] = f.token(i);
  d.ends.assign(f.ends().begin(), f.ends().end());
  d.mask = f.mask();
  return d;
}


}  // namespace composer

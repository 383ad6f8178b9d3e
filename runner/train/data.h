// Training data as a pure function of (seed, step, global sample index), so
// any split of the global batch over ranks and microbatches sees exactly the
// samples a single-device run sees. Synthetic data, a safetensors file, or a
// flat file of token ids.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "models/model.h"
#include "runner/config/config.h"

namespace composer {

// DataConfig with every "auto" decided, plus the shapes the model implies.
struct DataPlan {
  InputKind inputs = InputKind::kNormal;
  TargetKind targets = TargetKind::kNone;
  int64_t seq_len = 0;                 // token inputs
  models::InputSpec input;             // what the model consumes
  std::vector<int64_t> output_shape;   // per-sample model output shape
  torch::ScalarType dtype = torch::kFloat;
  bool documents = false;              // packed documents: batches carry doc_start
};

struct Batch {
  torch::Tensor inputs;   // (n, features) or (n, seq) int64
  torch::Tensor targets;  // undefined when the loss needs none
  // Packed documents (data.documents): (n, seq) int64, the position in its
  // window where each input token's document begins (models/sequence.h);
  // undefined otherwise. Never sliced by context parallelism: attention
  // needs the whole sequence's.
  torch::Tensor doc_start;
  // Packed documents without loss_on_boundary: targets that begin a document
  // are -100 (ignored), and this is the count of the others in the step's
  // whole global batch, the loss's divisor on every rank. 0 otherwise.
  double loss_tokens = 0;
};

// Decides inputs/targets for `model` and `loss`; `model` is run on one sample
// to learn its output shape. Throws ConfigError for incompatible choices.
DataPlan plan_data(const ExperimentConfig& c, models::Model& model);

class DataSet {
 public:
  virtual ~DataSet() = default;
  // Samples [begin, end) of the global batch of `step` (1-based).
  virtual Batch batch(int64_t step, int64_t begin, int64_t end) const = 0;
  // Reads every value once before launch and refuses what training would
  // trip over later (a token file's ids against the model's vocabulary).
  virtual void check_all() const {}
  // A line for the log about what the run will read, "" for nothing: a
  // blend's samples per source over steps [first, last].
  virtual std::string describe(int64_t /*first*/, int64_t /*last*/) const { return ""; }
  // Where global sample `global_index` comes from, for `composer plan
  // --samples`: a token file's {source, path, start, documents}; null for
  // data drawn from the seed.
  virtual nlohmann::json where(int64_t /*global_index*/) const { return nullptr; }
  // Whether reading ahead on a thread pays: files to read (token files). Data
  // drawn from the seed or held in memory is made when asked.
  virtual bool reads_ahead() const { return false; }
};

// data.<key> of `c`'s file, for errors about the data section.
SourceRef data_ref(const ExperimentConfig& c, const std::string& key);

// Reads a rank's samples of the next step on a background thread while this
// step trains (for data sets that read files: DataSet::reads_ahead): each
// rank reads the same range [begin, end) of every global batch (its
// data-parallel share; its microbatches are slices of it). A request outside
// the range, for a step not read ahead, or of a data set made when asked, is
// read on the calling thread. Slices equal what the data set gives for them,
// bit for bit.
class Prefetcher {
 public:
  Prefetcher(const DataSet& data, int64_t begin, int64_t end, int64_t last_step);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  // Samples [begin, end) of `step`; the first request of a step starts the
  // next step's read.
  Batch batch(int64_t step, int64_t begin, int64_t end);
  // The time batch() spent since the last call, in ms: the step's data wait.
  double take_wait_ms();

 private:
  struct Ahead;
  const DataSet& data_;
  int64_t begin_, end_, last_step_;
  std::unique_ptr<Ahead> ahead_;
  Batch current_;
  int64_t current_step_ = 0;
  double wait_ms_ = 0;
};

// The per-sample generator seed: splitmix64 over (seed, step, index), 63 bits.
uint64_t sample_seed(uint64_t seed, int64_t step, int64_t index);

// Where sample `global_index` of a token-file run starts, one of `positions`
// window starts: splitmix64 over (seed ^ "tokens", global_index), modulo.
uint64_t token_window(uint64_t seed, int64_t global_index, int64_t positions);

// Which of a blend's token files sample `global_index` comes from, given the
// weights' running sums `cumulative` (w0, w0+w1, ...): the first i with
// u < cumulative[i] / cumulative.back(), where u in [0, 1) is the top 53 bits
// of splitmix64(splitmix64(seed ^ "blend") ^ global_index) times 2^-53.
// docs/configuration.md#blended-sources; tools/reference/blend.py computes
// the same.
size_t blend_source(uint64_t seed, int64_t global_index, const std::vector<double>& cumulative);

// Where each of a window's tokens' document begins (a doc_start row):
// out[0] = 0 and out[k] = k after an end-of-document id at k-1, else out[k-1].
void doc_start_by_eos(const int64_t* window, int64_t len, int64_t eos_id, int64_t* out);

}  // namespace composer

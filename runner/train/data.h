// Training data as a pure function of (seed, step, global sample index), so
// any split of the global batch over ranks and microbatches sees exactly the
// samples a single-device run sees. Synthetic data, a safetensors file, or a
// flat file of token ids.
#pragma once
#include <torch/torch.h>

#include <memory>
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
};

struct Batch {
  torch::Tensor inputs;   // (n, features) or (n, seq) int64
  torch::Tensor targets;  // undefined when the loss needs none
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
};

std::unique_ptr<DataSet> make_dataset(const ExperimentConfig& c, const DataPlan& plan);

// The per-sample generator seed: splitmix64 over (seed, step, index), 63 bits.
uint64_t sample_seed(uint64_t seed, int64_t step, int64_t index);

// Where sample `global_index` of a token-file run starts, one of `positions`
// window starts: splitmix64 over (seed ^ "tokens", global_index), modulo.
uint64_t token_window(uint64_t seed, int64_t global_index, int64_t positions);

}  // namespace composer

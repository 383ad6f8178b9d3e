// What `composer diff` compares: one training step's tensors, recorded on
// each rank as that rank holds them. For every module of the rank (by FQN) the
// output of its first forward in each microbatch and, in backward, the
// gradient flowing into its input; for every parameter piece the rank holds,
// its value before the step, its gradient after the synchronisation and its
// value after the update. Each piece carries where it lies in the whole
// tensor (its samples, its context-parallel positions, its tensor-parallel
// rank, a parameter's box), which runner/verify/diff.h reads to compare it
// with the single-device run's tensor. The files' format: record_format.h.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "models/select.h"
#include "parallelisms/parallel.h"
#include "runner/base/safetensors.h"
#include "runner/checkpoint/checkpoint.h"
#include "runner/train/record_format.h"

namespace composer {

struct RecordOptions {
  // The step to record (1-based); 0 records nothing; kEveryStepsParams: only
  // the parameters after each step, into <dir>/step<k>/ (finding the first
  // step whose update parts from one device).
  static constexpr int64_t kEveryStepsParams = -1;
  int64_t step = 0;
  std::string dir;  // rank<r>.json (the entries) and rank<r>/<n>.safetensors (one tensor each) go here
  // FQN patterns (models/select.h): only the modules they select, the modules
  // inside those and their parameters are recorded; empty: every module.
  std::vector<std::string> modules;
};

// Whether `options` records module (or parameter owner) `fqn`.
bool records_module(const RecordOptions& options, const std::string& fqn);

// Where a rank's pieces of a step's activations lie in the whole step.
struct RecordLayout {
  int64_t batch_begin = 0;                // the rank's first sample in the global batch (as the plan means it)
  int64_t microbatch = 0;                 // samples per microbatch on this rank
  int64_t local_batch = 0;                // samples per step on this rank
  int64_t global_batch = 0, seq_len = 0;  // seq_len 0: inputs without a sequence
  // Backward on this rank runs on its loss share times this (data-parallel
  // size, context-parallel size, the pipeline's loss factor): the recorded
  // input gradients are divided by it.
  double grad_divisor = 1;
};

class StepRecorder {
 public:
  StepRecorder(RecordOptions options, const std::vector<models::Root>& roots, const parallel::Parallel& par,
               const std::vector<HeldParam>& held, int rank, RecordLayout layout);
  ~StepRecorder();
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  bool records(int64_t step) const { return step == options_.step; }
  bool records_params_every_step() const { return options_.step == RecordOptions::kEveryStepsParams; }
  // kEveryStepsParams: the parameters after `step`'s update, with their own rank<r>.json.
  void params_after(int64_t step);
  // At the start of the recorded step: the parameters, then the hooks.
  void begin();
  // The microbatch the next forward or backward action belongs to.
  void set_microbatch(int64_t mb) { microbatch_ = mb; }
  // After the gradient synchronisation, before the update: the gradients.
  void after_grad_sync();
  // After the update: the parameters; removes the hooks and writes the files.
  void end();

 private:
  struct State;
  void add(RecordKind kind, const std::string& name, const std::string& type, int64_t mb, const torch::Tensor& t,
           PiecePlace where);
  void add_params(RecordKind kind);
  PiecePlace activation_where() const;
  void hook(const std::string& name, nn::Module* m);
  void open_files_dir(const std::string& dir);

  void write_entries(const std::string& dir, int64_t step);

  RecordOptions options_;
  std::string files_dir_;  // where add() writes (options_.dir, or a step's folder)
  std::vector<std::pair<std::string, nn::Module*>> modules_;
  const parallel::Parallel& par_;
  const std::vector<HeldParam>& held_;
  int rank_;
  RecordLayout layout_;
  int64_t microbatch_ = 0;
  std::shared_ptr<State> state_;
};

}  // namespace composer

// Golden files: the per-step losses, gradient norms and final parameters of a
// single-device run (written by `composer golden` or tools/reference), and the
// comparison that `composer check` makes against them.
#pragma once
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/observe/metrics.h"
#include "runner/base/safetensors.h"

namespace composer {

constexpr int kGoldenFormat = 1;
// Tensors above this many elements keep a strided sample, not every value.
constexpr int64_t kGoldenFullLimit = int64_t{1} << 20;
constexpr int64_t kGoldenSamples = 512;

struct GoldenParam {
  std::string name;
  std::vector<int64_t> shape;
  torch::Tensor values;  // float64, flattened: every value, or the sample
  bool sampled = false;  // values hold elements i * numel / kGoldenSamples
  double l2 = 0;         // L2 norm of the whole tensor
};

struct Golden {
  nlohmann::json header;  // format_version, generator, command, config_hash, libtorch_version, dtype
  std::vector<StepRecord> steps;
  std::vector<GoldenParam> params;
};

// The initial weights a golden was trained from, beside it (x.json:
// x.init.safetensors, every parameter's float32 value by name). Its writers
// (composer golden, tools/reference) write it when the config draws its own
// (neither model.init_from nor from_hf); composer check then trains from
// them, after measuring the weights it drew against them: a CPU whose
// random-fill kernels round otherwise (ATen's without AVX2) draws values a few
// ulps off, so the golden's training is checked from the golden's start.
std::string golden_init_path(const std::string& golden_path);
bool draws_initial_weights(const ModelConfig& m);
// How far drawn initial weights may be from the golden's, as a share of each
// tensor's largest magnitude: another kernel's rounding (at most 2.1e-6 over
// the 50 goldens under ATEN_CPU_CAPABILITY=default), far from any change to
// how a model initialises (which moves whole values).
constexpr double kGoldenInitTolerance = 1e-5;

Golden make_golden(const ExperimentConfig& c, const std::vector<StepRecord>& steps, const NamedTensors& params,
                   const std::string& command);
void write_golden(const std::string& path, const Golden& g);
// Why these steps make a golden that cannot tell a right run from a wrong one
// (a loss or gradient norm that is 0 at some step, or the same at every step),
// or nullopt. The golden writers refuse such goldens.
std::optional<std::string> degenerate_steps(const std::vector<StepRecord>& steps);
Golden read_golden(const std::string& path);  // FileError when missing or malformed
// CheckFailed when `g` was not made for `c`: another config hash, dtype or
// mixed-precision policy (what compare() checks first).
void check_golden_header(const Golden& g, const ExperimentConfig& c);
Golden parse_golden(const std::string& text, const std::string& path);  // FileError (naming path) when malformed

struct CompareReport {
  bool ok = true;
  std::string first_failure;  // "step 3 loss: expected ..., actual ..., abs err ..., rel err ..."
  int64_t first_failure_step = 0;  // the step of the first per-step mismatch (0: none, or only final parameters)
  int failures = 0;
  int step_failures = 0;   // of them, in the per-step losses and gradient norms
  int param_failures = 0;  // in the final parameters
  double max_loss_abs_err = 0, max_loss_rel_err = 0, max_grad_norm_rel_err = 0;
  double max_param_abs_err = 0, max_param_rel_err = 0;
  std::string worst_param;
  int eval_losses = 0;  // eval losses compared (steps where the golden and the run both evaluated)
  double max_eval_rel_err = 0;
  // The largest error as a share of its bound (atol + rtol * |expected|) over
  // every loss, gradient norm and parameter element: 1 is the limit. How
  // close a passing check came to failing (another CPU's kernels move it).
  double max_tolerance_used = 0;
};

// A plan's fully_shard mixed precision ("bfloat16 compute, float32 gradient
// reduction", or a rounding all-gather), "" when it computes in train.dtype.
std::string plan_policy(const ExperimentConfig& c);

// Compares a run with a golden under the tolerances of `tol`. A golden made
// for a different config (hash) or dtype is a CheckFailed error.
CompareReport compare(const Golden& g, const ExperimentConfig& c, const std::vector<StepRecord>& steps,
                      const NamedTensors& params);

std::string base64_encode(const std::string& bytes);
std::string base64_decode(const std::string& text);  // throws std::invalid_argument

}  // namespace composer

// The experiment config's enum-valued keys and their YAML names
// (names_of(E{}) is what the field walk and name_of look up).
#pragma once
#include "parallelisms/config_fields.h"

namespace composer {

enum class Backend { kGloo, kNccl };
enum class DeviceKind { kCpu, kCuda };
enum class OptimizerKind { kSgd, kAdam, kAdamW, kMuon };
enum class Decay { kNone, kLinear, kCosine };
enum class LossKind { kSum, kMean, kMse, kCrossEntropy, kSoftCrossEntropy };
enum class DataSource { kSynthetic, kFile, kTokens };
enum class TokenDType { kUint16, kUint32 };
enum class InputKind { kAuto, kNormal, kUniform, kTokens };
enum class TargetKind { kAuto, kNone, kNormal, kUniform, kTokens, kNextTokens };
enum class OnNonFinite { kStop, kSkip };  // what a step with a non-finite loss or gradient does
enum class Fp8Recipe { kTensorwise };      // train.fp8's scaling: one dynamic scale per tensor
// Muon's learning-rate scale per matrix [A, B] (torch.optim.Muon's adjust_lr_fn):
// original sqrt(max(1, A / B)), match_rms_adamw 0.2 sqrt(max(A, B)).
enum class MuonAdjustLr { kOriginal, kMatchRmsAdamw };

// The enums' YAML names (names_of(E{}) is what the field walk and name_of look up).
inline constexpr EnumName<Backend> kBackends[] = {{Backend::kGloo, "gloo"}, {Backend::kNccl, "nccl"}};
inline constexpr EnumName<DeviceKind> kDevices[] = {{DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
inline constexpr EnumName<OptimizerKind> kOptimizers[] = {
    {OptimizerKind::kSgd, "sgd"},
    {OptimizerKind::kAdam, "adam"},
    {OptimizerKind::kAdamW, "adamw"},
    {OptimizerKind::kMuon, "muon"}};
inline constexpr EnumName<Decay> kDecays[] = {
    {Decay::kNone, "none"}, {Decay::kLinear, "linear"}, {Decay::kCosine, "cosine"}};
inline constexpr EnumName<LossKind> kLosses[] = {{LossKind::kSum, "sum"},
                                                 {LossKind::kMean, "mean"},
                                                 {LossKind::kMse, "mse"},
                                                 {LossKind::kCrossEntropy, "cross_entropy"},
                                                 {LossKind::kSoftCrossEntropy, "soft_cross_entropy"}};
inline constexpr EnumName<DataSource> kSources[] = {
    {DataSource::kSynthetic, "synthetic"}, {DataSource::kFile, "file"}, {DataSource::kTokens, "tokens"}};
inline constexpr EnumName<TokenDType> kTokenDTypes[] = {{TokenDType::kUint16, "uint16"},
                                                        {TokenDType::kUint32, "uint32"}};
inline constexpr EnumName<InputKind> kInputs[] = {{InputKind::kAuto, "auto"},
                                                  {InputKind::kNormal, "normal"},
                                                  {InputKind::kUniform, "uniform"},
                                                  {InputKind::kTokens, "tokens"}};
inline constexpr EnumName<TargetKind> kTargets[] = {
    {TargetKind::kAuto, "auto"},       {TargetKind::kNone, "none"},     {TargetKind::kNormal, "normal"},
    {TargetKind::kUniform, "uniform"}, {TargetKind::kTokens, "tokens"}, {TargetKind::kNextTokens, "next_tokens"}};
inline constexpr EnumName<OnNonFinite> kOnNonFinite[] = {{OnNonFinite::kStop, "stop"}, {OnNonFinite::kSkip, "skip"}};
inline constexpr EnumName<Fp8Recipe> kFp8Recipes[] = {{Fp8Recipe::kTensorwise, "tensorwise"}};
inline constexpr EnumName<MuonAdjustLr> kMuonAdjustLrs[] = {{MuonAdjustLr::kOriginal, "original"},
                                                          {MuonAdjustLr::kMatchRmsAdamw, "match_rms_adamw"}};
inline const auto& names_of(Backend) { return kBackends; }
inline const auto& names_of(DeviceKind) { return kDevices; }
inline const auto& names_of(OptimizerKind) { return kOptimizers; }
inline const auto& names_of(Decay) { return kDecays; }
inline const auto& names_of(LossKind) { return kLosses; }
inline const auto& names_of(DataSource) { return kSources; }
inline const auto& names_of(TokenDType) { return kTokenDTypes; }
inline const auto& names_of(InputKind) { return kInputs; }
inline const auto& names_of(TargetKind) { return kTargets; }
inline const auto& names_of(OnNonFinite) { return kOnNonFinite; }
inline const auto& names_of(Fp8Recipe) { return kFp8Recipes; }
inline const auto& names_of(MuonAdjustLr) { return kMuonAdjustLrs; }

// Fault injection: for testing the launcher, rank fail_rank fails at step
// fail_step, as fail_mode says; for testing the golden checks, `inject` makes
// every rank compute a wrong step the way a plausible bug would. Off by default.
enum class FailMode {
  kError,   // reports an error (exit 3), as a failing rank does
  kExit,    // exits with code 7 without reporting anything
  kSignal,  // kills itself with SIGKILL, as `kill -9` or the OOM killer would
};
enum class FailAt {
  kStep,         // at the start of step fail_step
  kBeforeIndex,  // in step fail_step's checkpoint save, after writing its rank file, before the index
};
enum class Inject {
  kNone,
  kGradX2,              // backward runs on twice the loss: gradients (and their norm) x 2
  kMicrobatchOffByOne,  // the last dp rank reads its batch one microbatch late
  kNanGrad,             // rank inject_rank's first gradient turns NaN at every step from inject_step on
  kSkipCollective,      // rank inject_rank leaves out its first all_reduce or reduce_scatter of step inject_step
  kNoDocumentMask,      // packed documents run together: no document mask, positions run on (data.documents)
  kModuleOutput,        // rank inject_rank's module inject_module returns its output x 1.01 in step inject_step
  kModuleGrad,          // ... the gradient flowing back into its input is x 1.01 in step inject_step
  kMuonLocalPiece,      // Muon orthogonalises each rank's own piece of a matrix, never the whole
};
inline constexpr EnumName<FailMode> kFailModes[] = {
    {FailMode::kError, "error"}, {FailMode::kExit, "exit"}, {FailMode::kSignal, "signal"}};
inline constexpr EnumName<FailAt> kFailAts[] = {{FailAt::kStep, "step"}, {FailAt::kBeforeIndex, "before_index"}};
inline constexpr EnumName<Inject> kInjects[] = {{Inject::kNone, "none"},
                                                {Inject::kGradX2, "grad_x2"},
                                                {Inject::kMicrobatchOffByOne, "microbatch_off_by_one"},
                                                {Inject::kNanGrad, "nan_grad"},
                                                {Inject::kSkipCollective, "skip_collective"},
                                                {Inject::kNoDocumentMask, "no_document_mask"},
                                                {Inject::kModuleOutput, "module_output"},
                                                {Inject::kModuleGrad, "module_grad"},
                                                {Inject::kMuonLocalPiece, "muon_local_piece"}};
inline const auto& names_of(FailMode) { return kFailModes; }
inline const auto& names_of(FailAt) { return kFailAts; }
inline const auto& names_of(Inject) { return kInjects; }

}  // namespace composer

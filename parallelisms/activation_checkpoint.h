// activation_checkpointing: a checkpointed unit's forward keeps no activations,
// only its input and the CPU generator's state; its backward restores that
// state, runs the forward again with grad enabled and back-propagates through
// it (torch.utils.checkpoint, which LibTorch lacks).
//
// The unit's forward is one autograd function whose inputs are the unit's
// input and every tensor its layers compute with (each parameter as the
// layer sees it: the parameter itself, a tensor-parallel shard, fully_shard's
// unsharded view). Its backward recomputes with an alias of each of those
// tensors in place of the layers' views and hands their gradients back to
// autograd as the function's input gradients, so they travel on through
// whatever links the view to its parameter (fully_shard's reduce-scatter, a
// leaf's accumulation and gradient-synchronisation hooks) exactly as without
// checkpointing. The recompute therefore computes with the parameters that
// are present when the unit's backward runs (fully_shard re-gathers those
// before it, so nothing is gathered twice), re-runs the collectives inside the
// unit (tensor parallel), and records its Linear layers for a zero-bubble W
// step when the forward ran under one.
#pragma once
#include <atomic>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/config_fields.h"

namespace composer::parallel {

// full: a unit keeps only its input and recomputes its whole forward in
// backward. op: it also keeps the outputs of its matrix products and
// attention (models/saved_ops.h) and recomputes only the rest.
enum class CheckpointMode { kFull, kOp };
inline constexpr EnumName<CheckpointMode> kCheckpointModeNames[] = {{CheckpointMode::kFull, "full"},
                                                                   {CheckpointMode::kOp, "op"}};
inline const auto& names_of(CheckpointMode) { return kCheckpointModeNames; }

// The `activation_checkpointing` transform's options (docs/configuration.md).
struct ActivationCheckpointingConfig {
  static constexpr const char* kKey = "activation_checkpointing";
  static constexpr Splits kSplits = Splits::kNothing;
  static constexpr bool kMovesActivations = false;  // recomputes, on the rank that ran it
  std::vector<std::string> units;
  int64_t every = 1;
  CheckpointMode mode = CheckpointMode::kFull;
  std::vector<std::string> ops{"linear", "attention"};
  int64_t ops_every = 1;

  template <class V>
  void fields(V& v) {
    v("units", units);                     // module FQN patterns, as fully_shard's (required)
    v("every", every, kPositive);          // checkpoint the every-th, 2 x every-th, ... matching unit
    v("mode", mode);                       // full, or op: keep the outputs of `ops` inside each unit
    v("ops", ops);                         // mode op: the ops whose outputs are kept: linear, attention
    v("ops_every", ops_every, kPositive);  // mode op: keep every ops_every-th of them in forward order
  }
  std::optional<FieldError> check(const std::set<std::string>& given) const;
  // mode op: the kinds of ops kept, as a mask of nn::SavedOps::Kind.
  unsigned kept_ops() const;
};

struct Applying;
struct Tracing;
// Checkpoints the selected units of the roots: how a unit computes, not where.
bool apply(Applying& a, const ActivationCheckpointingConfig& config);
// Recomputing changes no activation at a stage's edge.
void trace(Tracing& t, const ActivationCheckpointingConfig& config);

// The unit FQNs `options` checkpoint in `model`, in forward order.
std::vector<std::string> checkpoint_units(models::Model& model, const ActivationCheckpointingConfig& options);
std::vector<std::string> checkpoint_units(const models::NamedModules& modules, const ActivationCheckpointingConfig& options);

// Why `options` cannot checkpoint `model`: a pattern that matches no module,
// or units that nest. nullopt when they can.
std::optional<std::string> check_checkpoint_units(models::Model& model, const ActivationCheckpointingConfig& options);

class ActivationCheckpoint {
 public:
  // Checkpoints the selected units among the modules of `roots` (the model,
  // or this rank's pipeline stages).
  ActivationCheckpoint(const std::vector<models::Root>& roots, const ActivationCheckpointingConfig& options);
  const std::vector<std::string>& units() const { return units_; }
  // Backward recomputes so far (one per checkpointed unit and microbatch).
  int64_t recomputes() const { return recomputes_->load(); }
  // mode op: the ops whose kept output a recompute took back instead of computing (so far).
  int64_t kept_taken() const { return kept_taken_->load(); }

 private:
  std::vector<std::string> units_;
  std::shared_ptr<std::atomic<int64_t>> recomputes_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> kept_taken_ = std::make_shared<std::atomic<int64_t>>(0);
};

std::unique_ptr<ActivationCheckpoint> apply_activation_checkpointing(const std::vector<models::Root>& roots,
                                                                     const ActivationCheckpointingConfig& options);
std::unique_ptr<ActivationCheckpoint> apply_activation_checkpointing(models::Model& model,
                                                                     const ActivationCheckpointingConfig& options);

}  // namespace composer::parallel

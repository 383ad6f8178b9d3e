// The parallelize section of the experiment config: one struct per transform
// (its YAML key is kKey, its fields are its YAML keys and --set paths,
// parallelize[i].KEY.FIELD), the enums they use, and their reader.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "models/model.h"
#include "parallelisms/context_parallel.h"
#include "parallelisms/pipeline/schedule.h"
#include "runner/base/errors.h"
#include "runner/config/yaml_reader.h"

namespace composer {

enum class DType { kFloat32, kFloat64, kBFloat16, kFloat16 };
using Schedule = parallel::ScheduleKind;  // named by parallel::name_of
using Rotate = parallel::Rotate;          // named by parallel::name_of
// fully_shard's shard dim per parameter: dim 0, or (opposite_tp) the other
// dim than tensor parallelism shards (PyTorch's shard_placement_fn of 2.A.2).
enum class ShardPlacement { kDim0, kOppositeTp };
enum class AllGather { kPlain, kBfloat16, kSplitBfloat16 };  // names are the extensions'
enum class Offload { kNone, kCpu };
const char* name_of(DType v);
const char* name_of(ShardPlacement v);
const char* name_of(AllGather v);
const char* name_of(Offload v);
const char* name_of(models::TpStyle v);

// The transforms of `parallelize`, one struct each: its YAML key is kKey and
// its fields are its YAML keys (and --set paths, parallelize[i].KEY.FIELD).

struct PipelineConfig {
  static constexpr const char* kKey = "pipeline";
  std::vector<std::string> mesh_dim{"pp"};  // the one mesh dim whose ranks hold the stages
  Schedule schedule = Schedule::k1f1b;      // schedule name
  int64_t microbatches = 0;                 // microbatches per step (0 = pp size; zbv: 2 x pp)
  int64_t virtual_stages = 1;               // stages per rank (zbv: 2)
  std::vector<std::string> split_points;    // FQNs where a stage starts
  int64_t layers_per_stage = 0;             // layers per stage (0 = split evenly)
  bool scale_grads = true;                  // divide gradients by the microbatch count
};

struct TensorParallelConfig {
  static constexpr const char* kKey = "tensor_parallel";
  std::vector<std::string> mesh_dim{"tp"};  // the one mesh dim it shards over
  std::string plan = "default";             // the model's plan, or custom (then `styles`)
  models::TpPlan styles;                    // plan custom: the rules
  bool sequence_parallel = false;           // shard norms and residuals on the sequence dim
  bool loss_parallel = false;               // keep the logits sharded over the vocabulary (cross entropy over tp)
};

struct ContextParallelConfig {
  static constexpr const char* kKey = "context_parallel";
  std::vector<std::string> mesh_dim{"cp"};  // the one mesh dim whose ranks split each sequence
  bool load_balance = true;                 // rank i holds chunks i and 2cp-1-i of 2cp (else slice i of cp)
  Rotate rotate = Rotate::kRing;            // how keys and values reach every rank: ring or allgather
};

struct ActivationCheckpointingConfig {
  static constexpr const char* kKey = "activation_checkpointing";
  std::vector<std::string> units;  // module FQN patterns to checkpoint (required)
  int64_t every = 1;               // checkpoint every n-th matching unit
};

struct FullyShardConfig {
  static constexpr const char* kKey = "fully_shard";
  std::vector<std::string> mesh_dim{"dp"};  // one dim (FSDP) or [replicate, shard] (HSDP); "a+b" flattens dims
  std::vector<std::string> units;           // module FQN patterns; each match is a unit
  // reshard_after_forward: true, false or N, held as the group size the
  // unsharded parameters are resharded to after forward: 0 is the whole shard
  // group (true), 1 keeps them gathered (false), N keeps 1/N of them on each
  // rank and backward gathers over N consecutive ranks (FSDP2's integer form).
  int64_t reshard_after_forward = 0;
  SourceRef reshard_ref;                    // where reshard_after_forward was given
  std::optional<DType> param_dtype;         // compute dtype (unset = parameter dtype)
  std::optional<DType> reduce_dtype;        // gradient reduction dtype (unset = param_dtype)
  ShardPlacement shard_placement = ShardPlacement::kDim0;  // dim each parameter is sharded on
  AllGather all_gather = AllGather::kPlain;  // all-gather extension for float32 parameters
  Offload offload = Offload::kNone;          // cpu keeps shards and optimizer state on the host
  bool prefetch = true;                      // issue the next unit's all-gather early
  std::vector<std::string> per_rank;         // parameters (FQN patterns) each rank keeps its own
  int64_t per_rank_seed = -1;                // rank i draws them with the model's init under seed + i (-1: keep)
  SourceRef per_rank_ref;                    // where per_rank was given
};

struct ReplicateConfig {
  static constexpr const char* kKey = "replicate";
  std::vector<std::string> mesh_dim{"dp"};  // the dims whose ranks hold copies
  double bucket_mb = 25;                    // gradient bucket size
  std::vector<std::string> per_rank;        // parameters (FQN patterns) each rank keeps its own
  int64_t per_rank_seed = -1;               // rank i draws them with the model's init under seed + i (-1: keep)
  SourceRef per_rank_ref;                   // where per_rank was given
};

using TransformOptions = std::variant<PipelineConfig, TensorParallelConfig, ContextParallelConfig,
                                      ActivationCheckpointingConfig, FullyShardConfig, ReplicateConfig>;

// One entry of `parallelize`: its own options and where it was written.
struct TransformConfig {
  TransformOptions options;
  SourceRef ref;
  const char* name() const;                    // its YAML key
  std::vector<std::string> mesh_dim() const;   // the dims it spans, "a+b" entries split ([] for activation_checkpointing)
};

// Mesh dim entries with "a+b" (dims flattened into one, as fully_shard may shard over) split into their dims.
std::vector<std::string> flat_dims(const std::vector<std::string>& entries);

// The YAML keys of the transforms, in the order they must be listed.
std::vector<std::string> transform_names();

// Reads a dtype-valued key (float32, float64, bfloat16, float16) into `out` when present.
void read_dtype(YamlMap& m, const std::string& key, DType& out);

// The parallelize section of `root`: its transforms in the order written.
std::vector<TransformConfig> read_parallelize(YamlMap& root);

}  // namespace composer

// fully_shard (FSDP2 semantics): every parameter is sharded over the
// data-parallel group on one dim (torch.chunk pieces, ranks with empty pieces
// allowed). Modules matching `units` are sharding units, each with one
// all-gather of all its parameters before its forward and one reduce-scatter
// (averaged) of their gradients in backward; the root is the last unit and
// owns every parameter no other unit owns. With reshard_after_forward the
// unsharded storage is freed after the unit's forward and gathered again just
// before its backward. The next unit's all-gather is issued before the current
// unit computes (prefetch), in forward and in backward. The optimizer sees only
// the local shards.
//
// Mixed precision: the all-gather and the compute run in param_dtype, the
// gradient reduction in reduce_dtype; shards, their gradients and optimizer
// state keep the training dtype. HSDP: with a replicate group, parameters
// are Replicate over it; its gradient all-reduce, like every reduction other
// than the unit's reduce-scatter, is the gradient synchronisation's
// (grad_sync.h), read from the placements this transform records.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/config_fields.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

// How one parameter is sharded over the shard group.
struct ShardInfo {
  std::vector<int64_t> full_shape;  // the unsharded shape (tp-local under tensor parallelism)
  int64_t dim = 0;                  // the sharded dim
  std::vector<int64_t> sizes;       // every rank's size along `dim` (torch.chunk)
  int rank = 0;
  int world = 1;
  int64_t offset(int r) const;              // where rank r's piece starts along `dim`
  std::vector<int64_t> shard_shape(int r) const;
  std::vector<int64_t> padded_shape() const;  // every piece padded to the largest
};

// An all-gather extension (FSDP2's fsdp_pre_all_gather / fsdp_post_all_gather
// on the local shard): a parameter transforms its shard into the tensors to
// all-gather, and the gathered tensors back into its unsharded value.
class AllGatherExtension {
 public:
  virtual ~AllGatherExtension() = default;
  virtual std::string name() const = 0;
  // One or more tensors to all-gather for this rank's shard. Every rank must
  // return the same shapes and dtypes, so uneven shards pad themselves
  // (pad_shard). `param_dtype` is the compute dtype of the unsharded value.
  virtual std::vector<torch::Tensor> pre_all_gather(const torch::Tensor& shard, const ShardInfo& info,
                                                    c10::ScalarType param_dtype) const = 0;
  // gathered[i] stacks every rank's input i on a new leading dim ([world, ...]).
  // Writes the unsharded value (param_dtype, info.full_shape) into `out`,
  // which fully_shard owns and reuses (FSDP2's out= form), and returns it.
  virtual torch::Tensor post_all_gather(const std::vector<torch::Tensor>& gathered, const ShardInfo& info,
                                        c10::ScalarType param_dtype, const torch::Tensor& out) const = 0;
  // A one-rank group gathers nothing. An extension whose round trip is a cast
  // says so here, and fully_shard then calls write_alone() in place of both
  // halves: the shard (the whole parameter) written into `out` by one cast,
  // with no all-gather buffers and no copies through them.
  virtual bool writes_alone() const { return false; }
  virtual void write_alone(const torch::Tensor& /*shard*/, const ShardInfo& /*info*/,
                           c10::ScalarType /*param_dtype*/, const torch::Tensor& /*out*/) const {}
};

// This rank's shard padded along info.dim to the largest piece.
torch::Tensor pad_shard(const torch::Tensor& shard, const ShardInfo& info);
// [world, padded...] pieces -> the unsharded tensor (cropped, concatenated on
// info.dim), cast to `dtype`; written into `out` when it is defined.
torch::Tensor unpad_cat(const torch::Tensor& gathered, const ShardInfo& info, c10::ScalarType dtype,
                        const torch::Tensor& out);

// Built-in extensions, by name: "bfloat16" all-gathers float32 parameters in
// bfloat16 (half the bytes; the unsharded value is the bf16-rounded shard),
// "split_bfloat16" all-gathers two tensors per parameter (the bf16 part and the
// float32 remainder) and adds them back: exact, and a test of multi-tensor
// extensions. Returns nullptr for an unknown name.
std::shared_ptr<AllGatherExtension> make_all_gather_extension(const std::string& name);
std::vector<std::string> all_gather_extension_names();
// What a parameter without an extension all-gathers: its padded shard, cast
// to the compute dtype.
const AllGatherExtension& default_all_gather();

// fully_shard's shard dim per parameter: dim 0, or (opposite_tp) the other
// dim than tensor parallelism shards (PyTorch's shard_placement_fn of 2.A.2).
enum class ShardPlacement { kDim0, kOppositeTp };
inline constexpr EnumName<ShardPlacement> kShardPlacementNames[] = {{ShardPlacement::kDim0, "dim0"},
                                                                   {ShardPlacement::kOppositeTp, "opposite_tp"}};
inline const auto& names_of(ShardPlacement) { return kShardPlacementNames; }
// The all-gather extension for float32 parameters (all_gather_extension.cpp names them so).
enum class AllGather { kPlain, kBfloat16, kSplitBfloat16 };
inline constexpr EnumName<AllGather> kAllGatherNames[] = {
    {AllGather::kPlain, "plain"}, {AllGather::kBfloat16, "bfloat16"}, {AllGather::kSplitBfloat16, "split_bfloat16"}};
inline const auto& names_of(AllGather) { return kAllGatherNames; }
enum class Offload { kNone, kCpu };
inline constexpr EnumName<Offload> kOffloadNames[] = {{Offload::kNone, "none"}, {Offload::kCpu, "cpu"}};
inline const auto& names_of(Offload) { return kOffloadNames; }

// reshard_after_forward: true, false or N, held as the group size the
// unsharded parameters are resharded to after forward: 0 is the whole shard
// group (true), 1 keeps them gathered (false), N keeps 1/N of them on each
// rank and backward gathers over N consecutive ranks (FSDP2's integer form;
// whether N divides the shard group is the planner's check).
struct ReshardAfterForward {
  int64_t size = 0;
};

// The `fully_shard` transform's options (docs/configuration.md).
struct FullyShardConfig : PerRankFields {
  static constexpr const char* kKey = "fully_shard";
  static constexpr Splits kSplits = Splits::kBatch;
  static constexpr bool kMovesActivations = false;  // it moves parameters and gradients only
  std::vector<std::string> mesh_dim{"dp"};
  std::vector<std::string> units;
  ReshardAfterForward reshard_after_forward;
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  ShardPlacement shard_placement = ShardPlacement::kDim0;
  AllGather all_gather = AllGather::kPlain;
  Offload offload = Offload::kNone;
  bool prefetch = true;

  template <class V>
  void fields(V& v) {
    v("mesh_dim", mesh_dim, kOneOrList);  // one dim (FSDP) or [replicate, shard] (HSDP); "a+b" flattens dims
    v("units", units);                    // module FQN patterns; each match is a unit
    v("reshard_after_forward", reshard_after_forward);  // true, false or a group size N
    v("param_dtype", param_dtype);        // compute dtype (unset = the parameter dtype)
    v("reduce_dtype", reduce_dtype);      // gradient reduction dtype (unset = param_dtype)
    v("shard_placement", shard_placement);  // the dim each parameter is sharded on
    v("all_gather", all_gather);          // all-gather extension for float32 parameters
    v("offload", offload);                // cpu keeps shards and optimizer state on the host
    v("prefetch", prefetch);              // issue the next unit's all-gather early
    PerRankFields::fields(v);
  }
  std::optional<FieldError> check(const std::set<std::string>&) const {
    return check_per_rank();
  }
};

struct Applying;
struct Tracing;
// Shards the roots over the last of its dims (replicated over the first under HSDP).
bool apply(Applying& a, const FullyShardConfig& config);
// Gathering before each unit changes no activation at a stage's edge.
void trace(Tracing& t, const FullyShardConfig& config);

// fully_shard as a rank runs it.
struct FullyShardOptions {
  std::vector<std::string> units;     // module FQN patterns; each match is its own unit
  bool reshard_after_forward = FullyShardConfig{}.reshard_after_forward.size != 1;  // free unsharded parameters
                                                                                    // between forward and backward
  // Resharding to a smaller group (FSDP2's integer reshard_after_forward):
  // N consecutive ranks of the shard group, this rank among them. After a
  // unit's first all-gather of a step each rank keeps the gathered inputs of
  // 1/N of the shard group's ranks, and a re-gather (backward) all-gathers
  // those over this group instead of the whole shard group; they are dropped
  // at reshard(). nullptr: re-gathers span the whole shard group.
  Group* post_forward = nullptr;
  std::optional<c10::ScalarType> param_dtype;   // all-gather and compute dtype
  std::optional<c10::ScalarType> reduce_dtype;  // gradient reduction dtype (default: param_dtype)
  // Applied to every float32 parameter; nullptr all-gathers the shard itself.
  std::shared_ptr<AllGatherExtension> extension;
  // The dim to shard each parameter on (shard_placement_fn); nullptr = dim 0.
  std::function<int64_t(const torch::Tensor&)> shard_dim;
  Group* replicate = nullptr;         // HSDP: parameters are replicated over it
  bool prefetch = FullyShardConfig{}.prefetch;  // issue the next unit's all-gather early
  // Shards, their gradients and the optimizer state in pinned host memory
  // (offload: cpu on a GPU): each all-gather copies the shard to the device,
  // each reduce-scatter's result comes back, and the optimizer steps on the host.
  bool offload = false;
  // Parameters (FQN patterns; a module's select its parameters) each rank
  // keeps its own (per_rank.h): neither sharded nor reduced here.
  std::vector<std::string> per_rank;
  // Where each sharded parameter's placement is recorded (nullptr: nowhere).
  Placements* placements = nullptr;
  // Parameters an earlier transform already splits over the shard group's dim
  // (expert weights when fully_shard borrows expert_parallel's dim): left as
  // they are, neither gathered nor reduced here (only averaged over HSDP's
  // replicate dim); their modules cast them to the compute dtype. Null: none.
  std::function<bool(const torch::Tensor&)> already_split;
};

// The unit FQNs that `units` selects in `model` (outermost first, root last as
// ""), or an error naming a pattern that matches nothing.
std::optional<std::string> check_units(models::Model& model, const std::vector<std::string>& units);

class FullyShard {
 public:
  struct Param;
  struct Unit;
  // Shards the parameters of `roots` (the model, or this rank's pipeline
  // stages); each root is a unit of its own, kept gathered until reshard().
  FullyShard(const std::vector<models::Root>& roots, Group& group, const FullyShardOptions& options);
  FullyShard(models::Model& model, Group& group, const FullyShardOptions& options);
  ~FullyShard();

  Group& group() { return group_; }
  Group* post_forward_group() { return options_.post_forward; }
  Group* replicate_group() { return options_.replicate; }
  size_t num_units() const;
  // With false, backward holds the unit gradients back (gradient
  // accumulation); the microbatch that should reduce-scatter sets true first.
  void set_requires_sync(bool sync) { sync_ = sync; }
  // Drops the unsharded parameters (after backward; the next forward gathers
  // the updated shards again).
  void reshard();
  // Reduce-scatters the gradients held back while sync was off, one
  // collective per unit, into the shard gradients (a pipeline step's end).
  void flush();
  // How `p` is sharded, or nullptr.
  const ShardInfo* shard_info(const torch::Tensor& p) const;
  // Whether `p`'s shard lives in host memory (offload).
  bool offloads(const torch::Tensor& p) const;
  // Forward-only passes (evaluation): a unit that reshards after forward
  // does so even though no backward will regather it, so an evaluation holds
  // one unit gathered at a time, as a training forward does.
  void set_forward_only(bool on) { forward_only_ = on; }

  // Internal: the unit whose forward comes after `u` (nullptr at the end).
  Unit* next_in_forward(const Unit* u) const;
  Unit* prev_in_forward(const Unit* u) const;
  void record_forward(Unit* u);
  bool recording() const { return recording_; }
  Unit* in_flight = nullptr;  // the unit whose all-gather runs in the background
  enum BufferKind { kSend, kRecv, kGrad, kUnsharded, kNumBufferKinds };
  torch::Tensor take_buffer(BufferKind kind, int64_t bytes);
  void give_buffer(BufferKind kind, torch::Tensor t);
  c10::Device device() const { return device_; }  // where the pools live: meta in a dry run
  int64_t pooled_bytes() const { return pooled_bytes_; }  // every buffer the pools ever allocated

 private:
  // The constructor's stages: a unit, one parameter sharded into its unit,
  // each unit's buffer sizes, the mixed-precision casts at a
  // root, and a unit's gather and free hooks.
  void add_unit(const std::string& name, nn::Module* m, bool root);
  void shard_param(Unit& u, const std::string& name, const torch::Tensor& p, const std::vector<nn::Module*>& users);
  void size_pools();
  void cast_at(nn::Module& root);
  void install_hooks(Unit* u);

  Group& group_;
  FullyShardOptions options_;
  bool sync_ = true;
  bool recording_ = true;  // the first forward records the unit order
  bool forward_only_ = false;
  std::vector<Unit*> forward_order_;
  std::vector<torch::Tensor> pool_[kNumBufferKinds];  // reusable buffers, by kind
  int64_t pooled_bytes_ = 0;
  c10::Device device_ = c10::kCPU;
  std::vector<std::unique_ptr<Unit>> units_;
  std::unordered_map<const c10::TensorImpl*, Param*> by_impl_;
};

std::unique_ptr<FullyShard> apply_fully_shard(models::Model& model, Group& group, const FullyShardOptions& options);
std::unique_ptr<FullyShard> apply_fully_shard(const std::vector<models::Root>& roots, Group& group,
                                              const FullyShardOptions& options);

}  // namespace composer::parallel

// Inside `composer suggest`: what the search knows of a model, the shape of
// one candidate plan, and the cost model that prices it (runner/suggest/cost.cpp).
#pragma once
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <string>
#include <vector>

#include "parallelisms/pipeline/schedule.h"
#include "runner/config/config.h"
#include "runner/plan/planner.h"
#include "runner/suggest/world.h"

namespace composer::suggest_detail {

// What the search needs to know of the model: its matrix parameters, shape
// arguments and the modules that make units.
struct ModelFacts {
  double matrix_params = 0;     // per token: every 2-D weight but embedding tables (experts: top_k of them)
  double param_bytes = 0;       // every parameter
  double expert_bytes = 0;      // of them, the routed experts' stacks
  int64_t tensors = 0;          // parameter tensors
  int64_t layers = 0, dim = 0, kv_dim = 0, seq = 1;  // seq: tokens per sample (1: a feature model)
  // The widths of all heads' queries (and keys) and of their values, halved summed: dim for llama.
  int64_t attn_dim = 0;
  int64_t heads = 0, head_dim = 0, vocab = 0;
  bool latent_attention = false;  // multi-head latent attention (head_dim: a query's and key's width)
  double ffn_per_token = 0;     // a layer's feed-forward width a token passes through (experts: top_k of them)
  double split_ffn_share = 0;   // the layers with a feed-forward tensor_parallel splits (dense, or shared experts)
  int64_t experts = 0, top_k = 0, moe_layers = 0;
  double expert_matrix = 0;     // of matrix_params, the routed experts' (top_k of them per token)
  int64_t expert_hidden = 0;    // a routed expert's hidden width
  bool attention = false;
  std::vector<std::string> units;  // top-level modules, a list's children as 'name.*'
  bool has_layers = false;
  // Each of layers.N's own, in order (empty for a model without a layer list).
  struct Layer {
    double bytes = 0;         // its parameters' but the routed experts'
    double expert_bytes = 0;  // its routed experts' stacks
    double ffn = 0;           // its feed-forward width a token passes through, the routed experts left out
  };
  std::vector<Layer> per_layer;
  double first_bytes = 0;  // the parameters outside the layers that come before them (the embedding)
  double last_bytes = 0;   // and those after them (the final norm and the output)
};

enum class DpMode { kNone, kReplicate, kFullyShard, kHsdp };
enum class Ac { kNone, kOp, kFull };
enum class Precision { kAsGiven, kBf16, kFp8Tensorwise };

struct Shape {
  int64_t tp = 1, cp = 1, pp = 1, dp = 1, shard = 1;  // shard: HSDP's shard dim (within a node)
  DpMode dp_mode = DpMode::kNone;
  parallel::ScheduleKind schedule = parallel::ScheduleKind::k1f1b;
  int64_t virtual_stages = 1, microbatches = 1;
  Ac ac = Ac::kNone;
  int64_t ac_every = 1;  // checkpoint every ac_every-th layer
  bool keep = false;  // fully_shard and HSDP: reshard_after_forward false (no second all-gather in backward)
  int tp_style = 0;   // 0: sequence and loss parallel, 1: sequence parallel, 2: plain
  int64_t ep = 1;     // expert_parallel's ranks
  bool ep_borrows_dp = false;  // on the dp dim itself (efsdp), else its own dim beside dp
  int rotate = 0;     // context_parallel: 0 ring, 1 allgather, 2 alltoall
  Precision precision = Precision::kAsGiven;

  int64_t batch_split() const { return dp * (ep_borrows_dp ? 1 : ep); }  // the ranks that split the batch, cp aside
  // The layers of the rank holding the most: its virtual stages of ceil(layers / (pp x v)) each, the
  // first stages taking one more where they do not split evenly (pipeline_split_points).
  int64_t busiest_layers(int64_t layers) const;
  std::string name() const;
  // The plans that differ only in what buys memory at some cost: activation
  // checkpointing, and gradient accumulation without a pipeline.
  std::string family() const;
};

// The layers [begin, end) of each of the pp x v stages (one stage without a pipeline), the first stages one
// longer where they do not split evenly (the last ones hold the norm and the output).
std::vector<std::pair<int64_t, int64_t>> stage_layers(const Shape& s, int64_t layers);

// A pipeline's split_points for `layers` over pp x v stages that do not split them evenly, the first
// stages one layer longer (the last ones hold the norm and the output); empty where they split evenly.
std::vector<std::string> pipeline_split_points(const Shape& s, int64_t layers);

// The whole config of `s`: `doc` (the user's, its mesh and parallelize left out; `doc_text`: it emitted)
// with train.microbatches (unless `given` > 0: the config's own) and float8 where searched, then the mesh
// (with `mesh_extra`, e.g. ", device: cuda") and parallelize sections of `s`.
std::string config_of(const Shape& s, const ModelFacts& f, const YAML::Node& doc, const std::string& doc_text,
                      int64_t given, const std::string& mesh_extra);

// The facts of the model `c` names (built shape-only).
ModelFacts facts_of(const ExperimentConfig& c);

// The shape of the plan `c` writes (its mesh and parallelize; `plan`: its resolved microbatches), as the
// search would have written it; UserError for a plan outside the search's shapes.
Shape shape_of(const ExperimentConfig& c, const Plan& plan);

// Prices `s` on `w`: every term of Candidate::terms, per rank, in seconds.
StepTerms price(const Shape& s, const ModelFacts& f, const ExperimentConfig& c, World& w);

// A floor under the dry run's peak of `s` (its busiest rank), in closed form, in bytes: the rank's
// share of the parameters, their gradients and the optimizer's states, and the activations its first
// stage certainly keeps. The search passes over a plan whose floor exceeds the memory without running it dry.
double memory_floor(const Shape& s, const ModelFacts& f, const ExperimentConfig& c, const World& w);

}  // namespace composer::suggest_detail

// A model family's Hugging Face adapter: how a Hugging Face folder's
// config.json and tensors become the model's arguments and parameters, and
// back. Each family writes its adapter beside the model and names it in its
// declaration (ModelDecl::hf); runner/ reads and writes folders through this
// interface only, so no model's names appear there.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/model.h"

namespace composer::models {

// A config.json value an adapter refuses or cannot read; the reader adds the
// file's path. The message names the field, its value and the fix.
class HfError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class HfAdapter {
 public:
  virtual ~HfAdapter() = default;

  // config.json's model_type values the family reads ("llama", "mixtral").
  virtual std::vector<std::string> model_types() const = 0;
  // The model arguments a YAML may still give beside from_hf (the others come
  // from config.json).
  virtual std::vector<std::string> yaml_args() const { return {}; }
  // Sets `args` (holding their defaults, and what the YAML gave of yaml_args(),
  // listed in `given`) from config.json `j`, whose model_type is one of
  // model_types(). Throws HfError for a value the model cannot compute exactly.
  virtual void read_config(const nlohmann::json& j, ModelArgs& args, const std::vector<std::string>& given) const = 0;

  // Throws HfError for arguments no architecture the adapter writes computes.
  virtual void check_export(const ModelArgs& args) const = 0;
  // The config.json transformers reads for a model with `args`; `shape` gives
  // a parameter's full shape by name (widths the model may derive).
  using ShapeOf = std::function<std::vector<int64_t>(const std::string& name)>;
  virtual nlohmann::ordered_json write_config(const ModelArgs& args, const ShapeOf& shape) const = 0;

  // Hugging Face's name of parameter `name`; with `expert` >= 0, of that
  // expert's slice (dim 0) of a parameter stored one tensor per expert. ""
  // when Hugging Face has no such tensor.
  virtual std::string hf_name(const std::string& name, const ModelArgs& args, int64_t expert = -1) const = 0;
  // The parameter stored as Hugging Face tensor `hf`, and (`expert`, -1
  // otherwise) which expert's slice it is; "" when the model has none.
  virtual std::string name_of(const std::string& hf, const ModelArgs& args, int64_t* expert = nullptr) const = 0;
  // Whether parameter `name` is stored one tensor per expert (its dim 0).
  virtual bool per_expert(const std::string& name, const ModelArgs& args) const = 0;
  // Whether a folder's tensor `hf` is one the model does not use and reading skips.
  virtual bool ignored(const std::string& hf, const ModelArgs& args) const { return false; }

  // The groups of rows (heads) within which parameter `name`'s rows are
  // stored in another order; 0 when stored as the model holds them.
  virtual int64_t row_groups(const std::string& name, const ModelArgs& args) const { return 0; }
  // `w`, rows of `groups` whole groups, from the model's row order to Hugging
  // Face's within each group, and back.
  virtual torch::Tensor to_hf_rows(const torch::Tensor& w, int64_t groups) const { return w; }
  virtual torch::Tensor from_hf_rows(const torch::Tensor& w, int64_t groups) const { return w; }
};

// Rotary layouts: each head's rows in interleaved pairs (dims 2i, 2i+1; the
// model's, torchtitan's and Meta's) and in two halves (Hugging Face's
// rotate_half), for an adapter's to_hf_rows and from_hf_rows; a vector (a
// per-head norm's weight, its elements the rows) as a one-column matrix.
torch::Tensor rotary_pairs_to_halves(const torch::Tensor& w, int64_t heads);
torch::Tensor rotary_halves_to_pairs(const torch::Tensor& w, int64_t heads);

// config.json fields for adapters, each an HfError when of another type.
namespace hf {
std::string shown(const nlohmann::json& v);
bool given(const nlohmann::json& j, const std::string& key);  // present and not null
// An integer field; `fallback` when absent (else an HfError naming `model`, "a Llama config.json").
int64_t int_field(const nlohmann::json& j, const std::string& key, const int64_t* fallback, const std::string& model);
// An integer field that must be positive.
int64_t positive_field(const nlohmann::json& j, const std::string& key, const int64_t* fallback,
                       const std::string& model);
double float_field(const nlohmann::json& j, const std::string& key, double fallback);
bool bool_field(const nlohmann::json& j, const std::string& key, bool fallback);
// Refuses field `key` unless absent, null or equal to `want`; `why` the reason and fix.
void require_field(const nlohmann::json& j, const std::string& key, const nlohmann::json& want, const std::string& why);
// Refuses an architectures list naming anything but `arch`.
void require_architecture(const nlohmann::json& j, const std::string& arch);

// Names every decoder adapter shares. The tensors outside the layers (model.embed_tokens.weight,
// model.norm.weight, lm_head.weight and composer's tok_embeddings.weight, norm.weight,
// output.weight): the other side's name, "" for any other.
std::string top_hf_name(const std::string& name);
std::string top_name_of(const std::string& hf);
// Composer's "layers.N.REST" (`from_hf` false) or Hugging Face's "model.layers.N.REST" (true) as N
// and REST; false for any other name. layer_prefix(N, hf) is the other way.
bool split_layer(const std::string& name, bool from_hf, int64_t& layer, std::string& rest);
std::string layer_prefix(int64_t layer, bool hf);
// `name` (Hugging Face's when `from_hf`, else composer's) on the other side: a top-level name as
// top_hf_name or top_name_of give it, a layer's "...layers.N.REST" as the other side's prefix and
// `rest_of(N, REST)`; "" where that gives "" (no such tensor).
std::string renamed(const std::string& name, bool from_hf,
                    const std::function<std::string(int64_t layer, const std::string& rest)>& rest_of);
// Experts stored one tensor each: expert J's slice of composer's stacked
// feed_forward.experts.wK (K 1, 2, 3: gate, down, up) is "<prefix>J.<weight[K-1]>.weight".
struct ExpertNames {
  const char* prefix;     // "block_sparse_moe.experts.", "mlp.experts."
  const char* weight[3];  // w1, w2, w3's names
};
// REST's name on the other side within its layer ("" when REST is no expert weight, or `expert` < 0).
std::string expert_hf_name(const std::string& rest, const ExpertNames& n, int64_t expert);
std::string expert_name_of(const std::string& hf_rest, const ExpertNames& n, int64_t* expert);
// Whether composer's `name` is a stacked expert weight (layers.N.feed_forward.experts.wK).
bool stacked_expert(const std::string& name);
}  // namespace hf

}  // namespace composer::models

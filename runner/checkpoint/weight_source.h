// Initial weights read by composer's parameter names, one tensor at a time:
// model.init_from (a safetensors file in composer's own names) or
// model.from_hf (a Hugging Face Llama or Mixtral folder, model.safetensors or
// the shards of model.safetensors.index.json, whose names are mapped and whose
// q/k rows are put back in composer's rotary order; Mixtral's experts, one
// tensor each, are the slices of composer's stacked expert weights). Opening
// reads headers only.
//
// Hugging Face applies rotary embeddings to the two halves of each head's
// dimensions (rotate_half); composer's llama, like torchtitan and Meta's code,
// to interleaved pairs (dims 2i, 2i+1). Each head's rows of wq and wk are
// permuted between the two; wv, wo and the rest are the same matrices.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "models/model.h"
#include "runner/base/safetensors.h"
#include "runner/config/config.h"

namespace composer {

class WeightSource {
 public:
  // A safetensors file in composer's names.
  static std::unique_ptr<WeightSource> file(const std::string& path);
  // A Hugging Face Llama folder for llama with `args` (its heads order the q/k
  // rows), or a Mixtral folder when args.n_experts > 0.
  static std::unique_ptr<WeightSource> hf_folder(const std::string& dir, const models::ModelArgs& args);
  // The config's model.init_from or model.from_hf; null when it names neither.
  static std::unique_ptr<WeightSource> open(const ModelConfig& c);

  // Checks that the tensors are exactly `model`'s parameters (a tied one
  // under any of its names), with their shapes and floating point; a
  // FileError names the tensor as stored and its file otherwise. Returns the
  // name to read each parameter under. `shape_of` gives a parameter's full
  // shape where the transforms have already cut it (default: its sizes).
  using ShapeOf = std::function<std::vector<int64_t>(const torch::Tensor&)>;
  std::unordered_map<const c10::TensorImpl*, std::string> match(models::Model& model,
                                                                const ShapeOf& shape_of = {}) const;
  // Parameter `name`'s value in composer's layout, in the stored dtype.
  torch::Tensor read(const std::string& name) const;
  // The box (per dim: offset and size in the full tensor) of it, reading only
  // the bytes of the box's rows (for wq and wk of a Hugging Face folder: of the
  // whole heads the box touches, whose rows are permuted within each head; for
  // Mixtral's experts: of the experts the box spans).
  torch::Tensor read_box(const std::string& name, const std::vector<int64_t>& offset,
                         const std::vector<int64_t>& size) const;
  // The shape parameter `name` is stored with (in composer's layout).
  const std::vector<int64_t>& shape(const std::string& name) const { return tensors_.at(name).shape; }
  // The dtype parameter `name` is stored in.
  torch::ScalarType dtype(const std::string& name) const { return tensors_.at(name).dtype; }

 private:
  struct Stored {
    std::string file;
    SafetensorsEntry entry;  // entry.name: the stored name
  };
  // A parameter's stored tensors: one, or (stacked) one per expert, slices of dim 0.
  struct Param {
    std::vector<Stored> parts;
    bool stacked = false;
    std::vector<int64_t> shape;  // composer's
    torch::ScalarType dtype = torch::kFloat;
    static Param one(Stored s) {
      Param p;
      p.shape = s.entry.shape;
      p.dtype = s.entry.dtype;
      p.parts.push_back(std::move(s));
      return p;
    }
  };
  std::map<std::string, Param> tensors_;  // by composer name
  std::string where_;                     // the file or folder
  std::string model_name_;                // the config's model.name, for errors ("" when not opened from one)
  int64_t n_heads_ = 0, n_kv_heads_ = 0;  // a Hugging Face folder's heads (0: composer's layout)
  int64_t n_experts_ = 0;                 // a Mixtral folder's experts (0: dense)
  torch::Tensor read_stored_box(const Stored& s, const std::vector<int64_t>& offset,
                                const std::vector<int64_t>& size) const;
};

// Copies every tensor of `source` into the parameter of its name.
void load_weights(models::Model& model, const WeightSource& source);

// composer llama's name of a Hugging Face tensor, and back; "" for a name the
// other side does not have. `moe`: the names of MixtralForCausalLM, whose
// block_sparse_moe.gate is feed_forward.router and whose
// block_sparse_moe.experts.J.w{1,2,3}.weight is expert J (`expert`, -1 for
// other tensors), slice J on dim 0, of feed_forward.experts.w{1,2,3};
// otherwise LlamaForCausalLM's.
std::string llama_name_of_hf(const std::string& hf_name, bool moe, int64_t* expert = nullptr);
std::string hf_name_of_llama(const std::string& name, bool moe, int64_t expert = -1);
// Whether llama parameter `name` is a stacked expert weight (feed_forward.experts.w{1,2,3}).
bool is_llama_expert_weight(const std::string& name);

// Llama parameter `name` with value `w`, its wq/wk rows permuted between
// composer's interleaved rotary pairs and Hugging Face's halves (other
// parameters unchanged).
torch::Tensor llama_to_hf_layout(const std::string& name, const torch::Tensor& w, int64_t n_heads, int64_t n_kv_heads);
torch::Tensor hf_to_llama_layout(const std::string& name, const torch::Tensor& w, int64_t n_heads, int64_t n_kv_heads);

}  // namespace composer

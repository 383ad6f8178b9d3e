// Initial weights read by composer's parameter names, one tensor at a time:
// model.init_from (a safetensors file in composer's own names) or
// model.from_hf (a Hugging Face folder, model.safetensors or the shards of
// model.safetensors.index.json), read through the model's Hugging Face adapter
// (models/hf_adapter.h): its names mapped, rows the adapter stores in another
// order (rotary heads) put back in the model's, and tensors stored one per
// expert read as the slices of the model's stacked expert weights. Opening
// reads headers only.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "models/hf_adapter.h"
#include "models/model.h"
#include "runner/base/safetensors.h"
#include "runner/config/config.h"

namespace composer {

// The content hash of the weights model.from_hf or model.init_from names: FNV-1a 64 (hex) over the bytes
// of each safetensors file read, in the order read; "" when the config names neither (the run draws
// its weights from the seed).
std::string start_weights_hash(const ModelConfig& c);

class WeightSource {
 public:
  // A safetensors file in composer's names.
  static std::unique_ptr<WeightSource> file(const std::string& path);
  // A Hugging Face folder of model `spec` (which has an adapter) with `args`.
  static std::unique_ptr<WeightSource> hf_folder(const std::string& dir, const models::ModelSpec& spec,
                                                 const models::ModelArgs& args);
  // The config's model.init_from or model.from_hf; null when it names neither.
  // With model.lora_from, the PEFT adapter folder's tensors too, as the
  // parameters <layer>.lora_A and <layer>.lora_B of train.lora (`lora`),
  // lora_B's rows in the model's order; its adapter_config.json must say
  // lora's rank and alpha and plain LoRA (ConfigErrors naming lora_from).
  static std::unique_ptr<WeightSource> open(const ModelConfig& c, const std::optional<LoraConfig>& lora);

  // Checks that the tensors are exactly `model`'s parameters (a tied one
  // under any of its names) and any of its weight buffers
  // (nn::named_weight_buffers; a Hugging Face folder must hold those its
  // adapter names), with their shapes and floating point; a FileError names
  // the tensor as stored and its file otherwise. Returns the name to read
  // each parameter and held buffer under. `shape_of` gives a parameter's full
  // shape where the transforms have already cut it (default: its sizes).
  using ShapeOf = std::function<std::vector<int64_t>(const torch::Tensor&)>;
  // Parameters `drawn` names are left out: the file does not hold them (train.lora's adapters, drawn
  // after the base is read), and a tensor of that name in it is unexpected.
  std::unordered_map<const c10::TensorImpl*, std::string> match(
      models::Model& model, const ShapeOf& shape_of = {},
      const std::function<bool(const std::string&)>& drawn = {}) const;
  // Parameter `name`'s value in composer's layout, in the stored dtype.
  torch::Tensor read(const std::string& name) const;
  // The box (per dim: offset and size in the full tensor) of it, reading only
  // the bytes of the box's rows (for rows a Hugging Face folder stores in
  // another order: of the whole groups the box touches, whose rows are
  // permuted within each group; for experts stored one tensor each: of the
  // experts the box spans).
  torch::Tensor read_box(const std::string& name, const std::vector<int64_t>& offset,
                         const std::vector<int64_t>& size) const;
  // The shape parameter `name` is stored with (in composer's layout).
  const std::vector<int64_t>& shape(const std::string& name) const { return tensors_.at(name).shape; }
  // The dtype parameter `name` is stored in.
  torch::ScalarType dtype(const std::string& name) const { return tensors_.at(name).dtype; }
  // The folder's tensors that are no parameter of the model and that reading skips, as transformers
  // does (HfAdapter::ignored: DeepSeek-V3's multi-token prediction layer, stale rotary buffers).
  const std::vector<std::string>& skipped() const { return skipped_; }
  // "" or one line saying how many were skipped, with the first's name.
  std::string skipped_note() const;

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
  std::vector<std::string> skipped_;      // skipped(), in the order read
  std::string model_name_;                // the config's model.name, for errors ("" when not opened from one)
  std::shared_ptr<const models::HfAdapter> hf_;  // a Hugging Face folder's adapter (null: composer's layout)
  models::ModelArgs args_;                         // and the model's arguments
  SourceRef lora_from_;                            // model.lora_from, when its tensors are among tensors_
  std::string lora_file_;                          // its adapter_model.safetensors
  // Reads model.lora_from's adapters into tensors_ (a Hugging Face folder's source).
  void add_peft(const std::string& dir, const SourceRef& ref, const LoraConfig& lora);
  // model.lora_from's tensors against the model's adapters `params` (the
  // same layers, shapes): a ConfigError naming lora_from otherwise.
  void check_adapters(const std::map<std::string, torch::Tensor>& params, const ShapeOf& shape_of) const;
  // The row groups a tensor is stored with in another order (0: none).
  int64_t row_groups(const std::string& name) const;
  // A Hugging Face folder's tensor `hf` holding parameter `name` (or expert `expert`'s slice of it).
  std::string stored_name(const std::string& name, int64_t expert = -1) const;
  // Checks a parameter stored one tensor per expert (each present, one dtype) and sets its shape.
  void stack_experts(const std::string& name, Param& param) const;
  torch::Tensor read_stored_box(const Stored& s, const std::vector<int64_t>& offset,
                                const std::vector<int64_t>& size) const;
};

// Copies every tensor of `source` into the parameter of its name; the
// parameters `drawn` names (match's) keep their values.
void load_weights(models::Model& model, const WeightSource& source,
                  const std::function<bool(const std::string&)>& drawn = {});
// Copies into each weight buffer (nn::named_weight_buffers) the value `names` (match's) reads it under, if any.
void load_weight_buffers(models::Model& model, const WeightSource& source,
                         const std::unordered_map<const c10::TensorImpl*, std::string>& names);

}  // namespace composer

#include "runner/checkpoint/weight_source.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "models/registry.h"
#include "runner/base/errors.h"
#include "runner/checkpoint/checkpoint_index.h"
#include "runner/plan/plan_lora.h"

namespace composer {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<WeightSource> make() { return std::unique_ptr<WeightSource>(new WeightSource()); }

// Blocks layers.0 .. layers.<n-1> among the names (composer's) of `m`: n, the highest index + 1.
template <class Map>
int64_t layer_count(const Map& m) {
  static const std::regex layer(R"(layers\.(\d{1,9})\..+)");
  int64_t n = 0;
  for (const auto& [name, value] : m) {
    std::smatch k;
    if (std::regex_match(name, k, layer)) n = std::max<int64_t>(n, std::stoll(k[1].str()) + 1);
  }
  return n;
}

// A Hugging Face folder's safetensors files: model.safetensors, or the shards
// model.safetensors.index.json names (with the file of each tensor).
struct HfFiles {
  std::vector<std::string> files;
  std::map<std::string, std::string> file_of;  // Hugging Face name -> shard file (sharded folders)
  std::string index;                           // the index's path
};

HfFiles hf_files(const std::string& dir) {
  HfFiles out;
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  out.index = index.string();
  if (!fs::exists(index)) {
    if (!fs::exists(single)) {
      throw FileError(dir, "no model.safetensors or model.safetensors.index.json in the folder; from_hf names a "
                           "folder that transformers' save_pretrained wrote");
    }
    out.files.push_back(single.string());
    return out;
  }
  nlohmann::json j;
  try {
    std::ifstream in(index);
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw FileError(out.index, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object()) {
    throw FileError(out.index, "expected an object with a weight_map (tensor name -> shard file)");
  }
  std::set<std::string> seen;
  for (const auto& [name, f] : j.at("weight_map").items()) {
    if (!f.is_string()) throw FileError(out.index, "weight_map." + name + ": expected a file name");
    out.file_of[name] = (fs::path(dir) / f.get<std::string>()).string();
    if (seen.insert(out.file_of[name]).second) out.files.push_back(out.file_of[name]);
  }
  return out;
}

}  // namespace

std::string start_weights_hash(const ModelConfig& c) {
  std::vector<std::string> files;
  if (!c.from_hf.empty()) files = hf_files(c.from_hf).files;
  if (c.from_hf.empty() && !c.init_from.empty()) files.push_back(c.init_from);
  if (files.empty()) return "";
  uint64_t h = fnv1a64(nullptr, 0);
  std::vector<char> buf(8 << 20);
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) throw FileError(f, "cannot read the file");
    while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
      h = fnv1a64(buf.data(), static_cast<size_t>(in.gcount()), h);
    }
  }
  return hex64(h);
}

std::unique_ptr<WeightSource> WeightSource::file(const std::string& path) {
  auto s = make();
  s->where_ = path;
  for (auto& e : read_safetensors_entries(path)) s->tensors_[e.name] = Param::one({path, e});
  return s;
}

std::string WeightSource::stored_name(const std::string& name, int64_t expert) const {
  return hf_ ? hf_->hf_name(name, args_, expert) : name;
}

std::unique_ptr<WeightSource> WeightSource::hf_folder(const std::string& dir, const models::ModelSpec& spec,
                                                      const models::ModelArgs& args) {
  auto s = make();
  s->where_ = dir;
  s->hf_ = spec.hf;
  s->args_ = args;
  const HfFiles files = hf_files(dir);
  std::map<std::string, std::string> read_from;  // Hugging Face name -> the file it is read from
  const int64_t n_experts = spec.experts ? spec.experts(args) : 0;
  for (const auto& f : files.files) {
    for (auto& e : read_safetensors_entries(f)) {
      if (s->hf_->ignored(e.name, args)) {
        s->skipped_.push_back(e.name);
        continue;
      }
      if (!files.file_of.empty() && files.file_of.count(e.name) && files.file_of.at(e.name) != f) continue;
      int64_t expert = -1;
      const std::string name = s->hf_->name_of(e.name, args, &expert);
      if (name.empty()) {
        throw FileError(f, "unexpected tensor '" + e.name + "': not a parameter of model " + spec.name +
                               " (biases and other architectures are not supported)");
      }
      if (expert >= n_experts) {
        throw FileError(f, "unexpected tensor '" + e.name + "': expert " + std::to_string(expert) +
                               " of a model with " + std::to_string(n_experts) + " experts (config.json)");
      }
      read_from[e.name] = f;
      if (expert < 0) {
        s->tensors_[name] = Param::one({f, e});
        continue;
      }
      Param& stack = s->tensors_[name];  // expert J's weight is slice J of the model's stacked one
      stack.parts.resize(static_cast<size_t>(n_experts));
      stack.stacked = true;
      stack.parts[static_cast<size_t>(expert)] = {f, e};
    }
  }
  for (auto& [name, param] : s->tensors_) {
    if (param.stacked) s->stack_experts(name, param);
  }
  for (const auto& [name, f] : files.file_of) {
    if (!s->hf_->name_of(name, args).empty() && (!read_from.count(name) || read_from.at(name) != f)) {
      throw FileError(f, "missing tensor '" + name + "' that " + files.index + " places in it");
    }
  }
  return s;
}

void WeightSource::stack_experts(const std::string& name, Param& param) const {
  for (size_t j = 0; j < param.parts.size(); ++j) {
    if (param.parts[j].file.empty()) {
      throw FileError(where_, "missing tensor '" + stored_name(name, static_cast<int64_t>(j)) +
                                  "' that the model needs");
    }
    // Shapes are checked against the model's (match); stacked, the experts share one dtype.
    const SafetensorsEntry& first = param.parts[0].entry;
    const SafetensorsEntry& e = param.parts[j].entry;
    if (e.dtype != first.dtype) {
      throw FileError(param.parts[j].file, "tensor '" + e.name + "' is " + c10::toString(e.dtype) + " but '" +
                                               first.name + "' is " + c10::toString(first.dtype) +
                                               "; every expert's weight has one dtype");
    }
  }
  param.shape = param.parts[0].entry.shape;
  param.shape.insert(param.shape.begin(), static_cast<int64_t>(param.parts.size()));
  param.dtype = param.parts[0].entry.dtype;
}

std::string WeightSource::skipped_note() const {
  if (skipped_.empty()) return "";
  return "from_hf: " + std::to_string(skipped_.size()) + " tensor" + (skipped_.size() == 1 ? "" : "s") + " of " +
         where_ + " not read: no parameter of model " + model_name_ + ", and transformers skips " +
         (skipped_.size() == 1 ? "it" : "them") + " too (first: " + skipped_.front() + ")";
}

std::unique_ptr<WeightSource> WeightSource::open(const ModelConfig& c, const std::optional<LoraConfig>& lora) {
  std::unique_ptr<WeightSource> s;
  if (!c.from_hf.empty()) s = hf_folder(c.from_hf, *models::find_model(c.name), c.args);
  if (c.from_hf.empty() && !c.init_from.empty()) s = file(c.init_from);
  if (s) s->model_name_ = c.name;
  if (s && !c.lora_from.empty()) s->add_peft(c.lora_from, c.lora_from_ref, *lora);  // config checks: from_hf, lora
  return s;
}

namespace {

// adapter_config.json of a PEFT folder: plain LoRA with train.lora's rank and alpha, or a ConfigError naming ref.
void check_peft_config(const std::string& dir, const SourceRef& ref, const LoraConfig& lora) {
  const std::string path = (fs::path(dir) / "adapter_config.json").string();
  nlohmann::json j;
  std::ifstream in(path);
  if (!in) throw ConfigError(ref, path + ": no adapter_config.json; lora_from names a folder PEFT's save_pretrained wrote");
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(ref, path + ": not valid JSON: " + e.what());
  }
  const auto field = [&](const char* key) { return j.is_object() && j.contains(key) ? j.at(key) : nlohmann::json(); };
  const auto refuse = [&](const std::string& why) { throw ConfigError(ref, path + ": " + why); };
  if (field("peft_type") != "LORA") refuse("peft_type is " + field("peft_type").dump() + "; lora_from reads LORA adapters");
  for (const char* key : {"use_rslora", "use_dora", "fan_in_fan_out"}) {
    if (field(key) == true) refuse(std::string(key) + " is true; train.lora is plain LoRA on Linear layers");
  }
  if (!field("bias").is_null() && field("bias") != "none") refuse("bias is " + field("bias").dump() + "; train.lora trains no biases");
  if (!field("modules_to_save").is_null() && !field("modules_to_save").empty()) {
    refuse("modules_to_save names fully trained modules, which train.lora does not hold");
  }
  const nlohmann::json r = field("r"), alpha = field("lora_alpha");
  if (!r.is_number_integer() || r.get<int64_t>() != lora.rank) {
    refuse("r is " + r.dump() + " but train.lora.rank is " + std::to_string(lora.rank) + "; set train.lora.rank to the "
           "adapter's r");
  }
  if (!alpha.is_number() || alpha.get<double>() != lora.alpha) {
    refuse("lora_alpha is " + alpha.dump() + " but train.lora.alpha is " + c10::str(lora.alpha) + "; set "
           "train.lora.alpha to the adapter's lora_alpha");
  }
}

}  // namespace

void WeightSource::add_peft(const std::string& dir, const SourceRef& ref, const LoraConfig& lora) {
  check_peft_config(dir, ref, lora);
  lora_from_ = ref;
  lora_file_ = (fs::path(dir) / "adapter_model.safetensors").string();
  if (!fs::exists(lora_file_)) {
    throw ConfigError(ref, lora_file_ + ": no adapter_model.safetensors in the folder; save the adapter with "
                           "safe_serialization (PEFT's default)");
  }
  static const std::regex key(R"(base_model\.model\.(.+)\.lora_([AB])\.weight)");
  std::vector<SafetensorsEntry> entries;
  try {
    entries = read_safetensors_entries(lora_file_);
  } catch (const FileError& e) {
    throw ConfigError(ref, e.what());
  }
  for (auto& e : entries) {
    std::smatch m;
    int64_t expert = -1;
    std::string weight;
    if (std::regex_match(e.name, m, key)) weight = hf_->name_of(m[1].str() + ".weight", args_, &expert);
    if (weight.empty() || expert >= 0 || weight.size() < 7 || weight.compare(weight.size() - 7, 7, ".weight") != 0) {
      throw ConfigError(ref, lora_file_ + ": unexpected tensor '" + e.name + "': not the LoRA adapter (lora_A or "
                             "lora_B) of a Linear layer of model " + model_name_ + "; was it trained on another base?");
    }
    tensors_[weight.substr(0, weight.size() - 7) + ".lora_" + m[2].str()] = Param::one({lora_file_, e});
  }
}

int64_t WeightSource::row_groups(const std::string& name) const {
  if (!hf_) return 0;
  if (!is_lora_name(name)) return hf_->row_groups(name, args_);
  return name.back() == 'B' ? hf_->row_groups(lora_weight(name), args_) : 0;  // lora_B's rows are its weight's
}

std::unordered_map<const c10::TensorImpl*, std::string> WeightSource::match(
    models::Model& model, const ShapeOf& shape_of, const std::function<bool(const std::string&)>& drawn) const {
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!drawn || !drawn(item.key())) params.emplace(item.key(), item.value());
  }
  std::set<std::string> buffers;  // whole wherever held: their own sizes are their full shapes
  for (const auto& [name, b] : nn::named_weight_buffers(model)) {
    params.emplace(name, b);
    buffers.insert(name);
  }
  if (!lora_file_.empty()) check_adapters(params, shape_of);
  std::unordered_map<const c10::TensorImpl*, std::string> out;
  for (const auto& [name, stored] : tensors_) {
    const Stored& first = stored.parts.front();
    auto it = params.find(name);
    if (it == params.end()) {
      const std::string model_name = model_name_.empty() ? "the model" : "model " + model_name_;
      // A Hugging Face folder whose weights hold more layers than its config.json builds.
      const int64_t built = layer_count(params), stored = layer_count(tensors_);
      if (hf_ && stored > built && name.rfind("layers.", 0) == 0) {
        throw FileError(first.file, "unexpected tensor '" + first.entry.name + "': the weights hold " +
                                        std::to_string(stored) + " layers, but " + model_name + " is built with " +
                                        std::to_string(built) + " (num_hidden_layers in " + where_ +
                                        "/config.json); set num_hidden_layers to " + std::to_string(stored) +
                                        " there, or give the config.json these weights were saved with");
      }
      throw FileError(first.file,
                      "unexpected tensor '" + first.entry.name + "': " + model_name + " has no parameter of that name");
    }
    const std::vector<int64_t> shape =
        shape_of && !buffers.count(name) ? shape_of(it->second) : it->second.sizes().vec();
    for (const Stored& part : stored.parts) {
      const SafetensorsEntry& e = part.entry;
      // An expert's weight is one slice of the stacked parameter: its shape less the expert dim.
      const std::vector<int64_t> want =
          stored.stacked && !shape.empty() ? std::vector<int64_t>(shape.begin() + 1, shape.end()) : shape;
      if ((stored.stacked && (shape.empty() || shape[0] != static_cast<int64_t>(stored.parts.size()))) ||
          want != e.shape) {
        throw FileError(part.file, "tensor '" + e.name + "' has shape " + c10::str(c10::IntArrayRef(e.shape)) +
                                       " but the model's " + (e.name == name ? "" : name + " ") + "is " +
                                       c10::str(c10::IntArrayRef(shape)) +
                                       (stored.stacked ? " (one slice per expert)" : ""));
      }
      if (!c10::isFloatingType(e.dtype)) throw FileError(part.file, "tensor '" + e.name + "' is not floating point");
    }
    out[it->second.unsafeGetTensorImpl()] = name;  // a tied weight is read under any of its names
  }
  for (const auto& [name, p] : params) {
    if (out.count(p.unsafeGetTensorImpl())) continue;
    // A weight buffer is the model's own value unless the file holds it, or a Hugging Face folder should.
    if (buffers.count(name) && (!hf_ || stored_name(name).empty())) continue;
    const std::string stored = hf_ && hf_->per_expert(name, args_) ? stored_name(name, 0) : stored_name(name);
    throw FileError(where_, "missing tensor '" + (stored.empty() ? name : stored) + "' that the model needs");
  }
  return out;
}

void WeightSource::check_adapters(const std::map<std::string, torch::Tensor>& params, const ShapeOf& shape_of) const {
  const auto hf_module = [&](const std::string& name) {  // of <layer>.lora_X
    const std::string w = hf_->hf_name(lora_weight(name), args_);
    return w.substr(0, w.size() - 7);
  };
  const std::string fix = "; lora_from names an adapter PEFT trained on this base (model.from_hf) for the modules "
                          "train.lora.targets selects";
  for (const auto& [name, stored] : tensors_) {
    const SafetensorsEntry& e = stored.parts.front().entry;
    if (stored.parts.front().file != lora_file_) continue;
    auto it = params.find(name);
    if (it == params.end()) {
      throw ConfigError(lora_from_, lora_file_ + ": tensor '" + e.name + "' adapts " + hf_module(name) +
                                        ", which train.lora.targets does not select" + fix);
    }
    const std::vector<int64_t> shape = shape_of ? shape_of(it->second) : it->second.sizes().vec();
    if (shape != e.shape) {
      throw ConfigError(lora_from_, lora_file_ + ": tensor '" + e.name + "' has shape " +
                                        c10::str(c10::IntArrayRef(e.shape)) + " but the model's " + name + " is " +
                                        c10::str(c10::IntArrayRef(shape)) + ": the adapter was trained on another "
                                        "base" + fix);
    }
  }
  for (const auto& [name, p] : params) {
    if (is_lora_name(name) && !tensors_.count(name)) {
      throw ConfigError(lora_from_, lora_file_ + ": no adapter of " + hf_module(name) + " (" + name + "), which "
                                        "train.lora.targets selects" + fix);
    }
  }
}

torch::Tensor WeightSource::read(const std::string& name) const {
  const Param& s = tensors_.at(name);
  if (s.stacked) {
    std::vector<torch::Tensor> experts;
    for (const Stored& part : s.parts) experts.push_back(read_safetensors_tensor(part.file, part.entry));
    return torch::stack(experts);
  }
  torch::Tensor t = read_safetensors_tensor(s.parts[0].file, s.parts[0].entry);
  const int64_t groups = row_groups(name);
  return groups ? hf_->from_hf_rows(t, groups) : t;
}

// The box of a stored tensor: one read per run of contiguous bytes (a row of
// the box's last dim, or more where the trailing dims are whole).
torch::Tensor WeightSource::read_stored_box(const Stored& s, const std::vector<int64_t>& offset,
                                            const std::vector<int64_t>& size) const {
  const auto& shape = s.entry.shape;
  TORCH_INTERNAL_ASSERT(offset.size() == shape.size() && size.size() == shape.size(), "a box of ", shape.size(),
                        " dims for tensor ", s.entry.name);
  torch::Tensor out = torch::empty(size, torch::dtype(s.entry.dtype));
  if (out.numel() == 0) return out;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(s.entry.dtype));
  const int64_t dims = static_cast<int64_t>(shape.size());
  // The innermost dims the box spans whole (after the first it cuts) are read with it in one run.
  int64_t run_dims = dims, run = 1;
  std::vector<int64_t> stride(shape.size(), 1);
  for (int64_t d = dims - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];
  for (int64_t d = dims - 1; d >= 0; --d) {
    run *= size[d];
    run_dims = d;
    if (offset[d] != 0 || size[d] != shape[d]) break;
  }
  std::ifstream in(s.file, std::ios::binary);
  if (!in) throw FileError(s.file, "cannot open the safetensors file; check the path");
  unsigned char len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len[i];
  const int64_t data = static_cast<int64_t>(8 + header_len + s.entry.begin);
  char* dst = static_cast<char*>(out.data_ptr());
  std::vector<int64_t> index(static_cast<size_t>(run_dims), 0);  // over the dims before the run
  while (true) {
    int64_t at = 0;
    for (int64_t d = 0; d < run_dims; ++d) at += (offset[d] + index[d]) * stride[d];
    if (run_dims < dims) at += offset[run_dims] * stride[run_dims];
    in.seekg(static_cast<std::streamoff>(data + at * elem));
    in.read(dst, static_cast<std::streamsize>(run * elem));
    if (!in) throw FileError(s.file, "cannot read tensor '" + s.entry.name + "'; the file is truncated");
    dst += run * elem;
    int64_t d = run_dims - 1;
    while (d >= 0 && ++index[d] == size[d]) index[d--] = 0;
    if (d < 0) break;
  }
  return out;
}

torch::Tensor WeightSource::read_box(const std::string& name, const std::vector<int64_t>& offset,
                                     const std::vector<int64_t>& size) const {
  const Param& p = tensors_.at(name);
  if (p.stacked) {  // the experts the box spans, each its box of the rest
    const std::vector<int64_t> o(offset.begin() + 1, offset.end()), z(size.begin() + 1, size.end());
    std::vector<torch::Tensor> experts;
    for (int64_t j = offset[0]; j < offset[0] + size[0]; ++j) {
      experts.push_back(read_stored_box(p.parts.at(static_cast<size_t>(j)), o, z));
    }
    return experts.empty() ? torch::empty(size, torch::dtype(p.dtype)) : torch::stack(experts);
  }
  const Stored& s = p.parts[0];
  const int64_t heads = row_groups(name);
  if (!heads) return read_stored_box(s, offset, size);
  // Hugging Face's rows of the whole groups the box touches, put in the model's order, then cut.
  const int64_t head_dim = s.entry.shape.at(0) / heads;
  const int64_t first = offset[0] / head_dim, last = (offset[0] + size[0] + head_dim - 1) / head_dim;
  std::vector<int64_t> o = offset, z = size;
  o[0] = first * head_dim;
  z[0] = (last - first) * head_dim;
  const torch::Tensor rows = hf_->from_hf_rows(read_stored_box(s, o, z), last - first);
  return rows.narrow(0, offset[0] - o[0], size[0]).contiguous();
}

void load_weights(models::Model& model, const WeightSource& source,
                  const std::function<bool(const std::string&)>& drawn) {
  const auto names = source.match(model, {}, drawn);
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : nn::unique_named_parameters(model)) {
    if (!drawn || !drawn(name)) p.copy_(source.read(names.at(p.unsafeGetTensorImpl())));
  }
  load_weight_buffers(model, source, names);
}

void load_weight_buffers(models::Model& model, const WeightSource& source,
                         const std::unordered_map<const c10::TensorImpl*, std::string>& names) {
  torch::NoGradGuard no_grad;
  for (auto& [name, b] : nn::named_weight_buffers(model)) {
    auto it = names.find(b.unsafeGetTensorImpl());
    if (it != names.end()) b.copy_(source.read(it->second));
  }
}

}  // namespace composer

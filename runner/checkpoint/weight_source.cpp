#include "runner/checkpoint/weight_source.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "runner/base/errors.h"

namespace composer {
namespace {

namespace fs = std::filesystem;

// Hugging Face's per-layer names and composer llama's.
const std::pair<const char*, const char*> kLayerNames[] = {
    {"input_layernorm.weight", "attention_norm.weight"},
    {"self_attn.q_proj.weight", "attention.wq.weight"},
    {"self_attn.k_proj.weight", "attention.wk.weight"},
    {"self_attn.v_proj.weight", "attention.wv.weight"},
    {"self_attn.o_proj.weight", "attention.wo.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate_proj.weight", "feed_forward.w1.weight"},
    {"mlp.down_proj.weight", "feed_forward.w2.weight"},
    {"mlp.up_proj.weight", "feed_forward.w3.weight"}};
// Mixtral's router (its experts' weights are block_sparse_moe.experts.J.w{1,2,3}.weight).
const char* const kRouterName = "block_sparse_moe.gate.weight";
const std::pair<const char*, const char*> kTopNames[] = {
    {"model.embed_tokens.weight", "tok_embeddings.weight"}, {"model.norm.weight", "norm.weight"},
    {"lm_head.weight", "output.weight"}};

// Heads of parameter `name`'s rows when its rows are rotary (wq, wk); 0 otherwise.
int64_t rotary_heads(const std::string& name, int64_t n_heads, int64_t n_kv_heads) {
  auto ends = [&](const char* tail) {
    const std::string t(tail);
    return name.size() >= t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
  };
  if (ends("attention.wq.weight")) return n_heads;
  if (ends("attention.wk.weight")) return n_kv_heads;
  return 0;
}

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

}  // namespace

std::string llama_name_of_hf(const std::string& hf, bool moe, int64_t* expert) {
  if (expert) *expert = -1;
  for (const auto& [h, c] : kTopNames) {
    if (hf == h) return c;
  }
  static const std::regex layer(R"(model\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(hf, m, layer)) return "";
  const std::string at = "layers." + m[1].str() + ".", rest = m[2].str();
  for (const auto& [h, c] : kLayerNames) {
    if (moe && std::string(c).rfind("feed_forward.", 0) == 0) continue;  // an MoE block has no dense SwiGLU
    if (rest == h) return at + c;
  }
  if (!moe) return "";
  if (rest == kRouterName) return at + "feed_forward.router.weight";
  static const std::regex expert_weight(R"(block_sparse_moe\.experts\.(0|[1-9]\d{0,8})\.(w[123])\.weight)");
  std::smatch e;
  if (!std::regex_match(rest, e, expert_weight)) return "";
  if (expert) *expert = std::stoll(e[1].str());
  return at + "feed_forward.experts." + e[2].str();
}

std::string hf_name_of_llama(const std::string& name, bool moe, int64_t expert) {
  for (const auto& [h, c] : kTopNames) {
    if (name == c) return h;
  }
  static const std::regex layer(R"(layers\.(\d+)\.(.+))");
  std::smatch m;
  if (!std::regex_match(name, m, layer)) return "";
  const std::string at = "model.layers." + m[1].str() + ".", rest = m[2].str();
  for (const auto& [h, c] : kLayerNames) {
    if (rest == c && !(moe && rest.rfind("feed_forward.", 0) == 0)) return at + h;
  }
  if (!moe) return "";
  if (rest == "feed_forward.router.weight") return at + kRouterName;
  static const std::regex expert_weight(R"(feed_forward\.experts\.(w[123]))");
  std::smatch e;
  if (!std::regex_match(rest, e, expert_weight) || expert < 0) return "";
  return at + "block_sparse_moe.experts." + std::to_string(expert) + "." + e[1].str() + ".weight";
}

bool is_llama_expert_weight(const std::string& name) {
  static const std::regex expert_weight(R"(layers\.\d+\.feed_forward\.experts\.w[123])");
  return std::regex_match(name, expert_weight);
}

torch::Tensor llama_to_hf_layout(const std::string& name, const torch::Tensor& w, int64_t n_heads, int64_t n_kv_heads) {
  const int64_t heads = rotary_heads(name, n_heads, n_kv_heads);
  if (!heads) return w;
  const int64_t head_dim = w.size(0) / heads, dim = w.size(1);
  return w.view({heads, head_dim / 2, 2, dim}).transpose(1, 2).reshape({heads * head_dim, dim});
}

torch::Tensor hf_to_llama_layout(const std::string& name, const torch::Tensor& w, int64_t n_heads, int64_t n_kv_heads) {
  const int64_t heads = rotary_heads(name, n_heads, n_kv_heads);
  if (!heads) return w;
  const int64_t head_dim = w.size(0) / heads, dim = w.size(1);
  return w.view({heads, 2, head_dim / 2, dim}).transpose(1, 2).reshape({heads * head_dim, dim});
}

std::unique_ptr<WeightSource> WeightSource::file(const std::string& path) {
  auto s = make();
  s->where_ = path;
  for (auto& e : read_safetensors_entries(path)) s->tensors_[e.name] = Param::one({path, e});
  return s;
}

std::unique_ptr<WeightSource> WeightSource::hf_folder(const std::string& dir, const models::ModelArgs& args) {
  auto s = make();
  s->where_ = dir;
  s->n_heads_ = args.i("n_heads");
  s->n_kv_heads_ = args.i("n_kv_heads") ? args.i("n_kv_heads") : s->n_heads_;
  s->n_experts_ = args.i("n_experts");
  const bool moe = s->n_experts_ > 0;
  const char* arch = moe ? "MixtralForCausalLM" : "LlamaForCausalLM";
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  std::map<std::string, std::string> file_of;  // Hugging Face name -> shard file (sharded folders)
  std::vector<std::string> files;
  if (fs::exists(index)) {
    nlohmann::json j;
    try {
      std::ifstream in(index);
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw FileError(index.string(), std::string("not valid JSON: ") + e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j.at("weight_map").is_object()) {
      throw FileError(index.string(), "expected an object with a weight_map (tensor name -> shard file)");
    }
    std::set<std::string> seen;
    for (const auto& [name, f] : j.at("weight_map").items()) {
      if (!f.is_string()) throw FileError(index.string(), "weight_map." + name + ": expected a file name");
      file_of[name] = (fs::path(dir) / f.get<std::string>()).string();
      if (seen.insert(file_of[name]).second) files.push_back(file_of[name]);
    }
  } else if (fs::exists(single)) {
    files.push_back(single.string());
  } else {
    throw FileError(dir, "no model.safetensors or model.safetensors.index.json in the folder; from_hf names a "
                         "folder that transformers' save_pretrained wrote");
  }
  std::map<std::string, std::string> read_from;  // Hugging Face name -> the file it is read from
  for (const auto& f : files) {
    for (auto& e : read_safetensors_entries(f)) {
      static const std::string kInvFreq = "rotary_emb.inv_freq";  // older folders kept the rotary buffer
      const size_t n = kInvFreq.size();
      if (e.name.size() >= n && e.name.compare(e.name.size() - n, n, kInvFreq) == 0) continue;
      if (!file_of.empty() && file_of.count(e.name) && file_of.at(e.name) != f) continue;  // the index names another
      int64_t expert = -1;
      const std::string name = llama_name_of_hf(e.name, moe, &expert);
      if (name.empty()) {
        throw FileError(f, "unexpected tensor '" + e.name + "': not a parameter of a " + arch +
                               " that composer's llama has (biases and other architectures are not supported)");
      }
      if (expert >= s->n_experts_) {
        throw FileError(f, "unexpected tensor '" + e.name + "': expert " + std::to_string(expert) +
                               " of a model with " + std::to_string(s->n_experts_) +
                               " experts (config.json's num_local_experts)");
      }
      read_from[e.name] = f;
      if (expert < 0) {
        s->tensors_[name] = Param::one({f, e});
        continue;
      }
      Param& stack = s->tensors_[name];  // expert J's weight is slice J of composer's stacked one
      stack.parts.resize(static_cast<size_t>(s->n_experts_));
      stack.stacked = true;
      stack.parts[static_cast<size_t>(expert)] = {f, e};
    }
  }
  for (auto& [name, param] : s->tensors_) {
    if (!param.stacked) continue;
    for (size_t j = 0; j < param.parts.size(); ++j) {
      if (param.parts[j].file.empty()) {
        throw FileError(
            dir, "missing tensor '" + hf_name_of_llama(name, true, static_cast<int64_t>(j)) + "' that the model needs");
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
  for (const auto& [name, f] : file_of) {
    const std::string mine = llama_name_of_hf(name, moe);
    if (!mine.empty() && (!read_from.count(name) || read_from.at(name) != f)) {
      throw FileError(f, "missing tensor '" + name + "' that " + index.string() + " places in it");
    }
  }
  return s;
}

std::unique_ptr<WeightSource> WeightSource::open(const ModelConfig& c) {
  std::unique_ptr<WeightSource> s;
  if (!c.from_hf.empty()) s = hf_folder(c.from_hf, c.args);
  if (c.from_hf.empty() && !c.init_from.empty()) s = file(c.init_from);
  if (s) s->model_name_ = c.name;
  return s;
}

std::unordered_map<const c10::TensorImpl*, std::string> WeightSource::match(models::Model& model,
                                                                          const ShapeOf& shape_of) const {
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) params.emplace(item.key(), item.value());
  std::unordered_map<const c10::TensorImpl*, std::string> out;
  for (const auto& [name, stored] : tensors_) {
    const Stored& first = stored.parts.front();
    auto it = params.find(name);
    if (it == params.end()) {
      const std::string model_name = model_name_.empty() ? "the model" : "model " + model_name_;
      // A Hugging Face folder whose weights hold more layers than its config.json builds.
      const int64_t built = layer_count(params), stored = layer_count(tensors_);
      if (n_heads_ && stored > built && name.rfind("layers.", 0) == 0) {
        throw FileError(first.file, "unexpected tensor '" + first.entry.name + "': the weights hold " +
                                        std::to_string(stored) + " layers, but " + model_name + " is built with " +
                                        std::to_string(built) + " (num_hidden_layers in " + where_ +
                                        "/config.json); set num_hidden_layers to " + std::to_string(stored) +
                                        " there, or give the config.json these weights were saved with");
      }
      throw FileError(first.file,
                      "unexpected tensor '" + first.entry.name + "': " + model_name + " has no parameter of that name");
    }
    const std::vector<int64_t> shape = shape_of ? shape_of(it->second) : it->second.sizes().vec();
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
    const std::string stored = n_heads_ ? hf_name_of_llama(name, n_experts_ > 0, 0) : name;
    throw FileError(where_, "missing tensor '" + (stored.empty() ? name : stored) + "' that the model needs");
  }
  return out;
}

torch::Tensor WeightSource::read(const std::string& name) const {
  const Param& s = tensors_.at(name);
  if (s.stacked) {
    std::vector<torch::Tensor> experts;
    for (const Stored& part : s.parts) experts.push_back(read_safetensors_tensor(part.file, part.entry));
    return torch::stack(experts);
  }
  torch::Tensor t = read_safetensors_tensor(s.parts[0].file, s.parts[0].entry);
  return n_heads_ ? hf_to_llama_layout(name, t, n_heads_, n_kv_heads_) : t;
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
  const int64_t heads = n_heads_ ? rotary_heads(name, n_heads_, n_kv_heads_) : 0;
  if (!heads) return read_stored_box(s, offset, size);
  // Hugging Face's rows of the whole heads the box touches, put in composer's order, then cut.
  const int64_t head_dim = s.entry.shape.at(0) / heads;
  const int64_t first = offset[0] / head_dim, last = (offset[0] + size[0] + head_dim - 1) / head_dim;
  std::vector<int64_t> o = offset, z = size;
  o[0] = first * head_dim;
  z[0] = (last - first) * head_dim;
  const torch::Tensor rows = hf_to_llama_layout(name, read_stored_box(s, o, z), last - first, last - first);
  return rows.narrow(0, offset[0] - o[0], size[0]).contiguous();
}

void load_weights(models::Model& model, const WeightSource& source) {
  const auto names = source.match(model);
  torch::NoGradGuard no_grad;
  for (auto& [name, p] : nn::unique_named_parameters(model)) p.copy_(source.read(names.at(p.unsafeGetTensorImpl())));
}

}  // namespace composer

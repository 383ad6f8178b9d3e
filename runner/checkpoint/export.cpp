#include "runner/checkpoint/export.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "parallelisms/comm/collectives.h"
#include "runner/checkpoint/checkpoint.h"
#include "runner/checkpoint/checkpoint_reader.h"
#include "runner/checkpoint/weight_source.h"
#include "runner/config/hf_config.h"
#include "runner/plan/plan_lora.h"
#include "runner/base/errors.h"
#include "runner/base/safetensors.h"
#include "models/registry.h"

namespace composer {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kMaxDims = 8;  // of a piece's box in the list a rank sends to rank 0

std::vector<int64_t> global_shape(const torch::Tensor& p, const parallel::ShardSpec* spec) {
  return spec ? spec->global_shape : p.sizes().vec();
}

// Whether this rank sends (or, rank 0, keeps) a piece of the tensor: the
// counting copy of a piece it holds; a tensor without a placement is whole on
// every rank, and rank 0's copy counts.
bool owns(const parallel::ShardSpec* spec, int rank) { return spec ? spec->held() && spec->counts() : rank == 0; }

parallel::Box box_of(const torch::Tensor& p, const parallel::ShardSpec* spec) {
  if (spec) return spec->box();
  std::vector<int64_t> size = p.dim() == 0 ? std::vector<int64_t>{1} : p.sizes().vec();
  return {std::vector<int64_t>(size.size(), 0), size};
}

// Copies `piece` into its box of `full` (a 0-dim tensor is its [1] box).
void place(torch::Tensor& full, const parallel::Box& box, const torch::Tensor& piece) {
  torch::Tensor dst = full.dim() == 0 ? full.view({1}) : full;
  for (size_t d = 0; d < box.size.size(); ++d) dst = dst.narrow(static_cast<int64_t>(d), box.offset[d], box.size[d]);
  dst.copy_(piece.view(box.size));
}

constexpr int64_t kRowWidth = 1 + 2 * kMaxDims;  // of a row in the list a rank sends to rank 0

// Who sends which box of each tensor to rank 0, in rank order.
using Sources = std::vector<std::vector<std::pair<int, parallel::Box>>>;

// The parameters and weight buffers write_final_weights gathers, and where each rank's pieces of them lie.
struct FinalWeights {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  const parallel::Placements* placements = nullptr;

  const parallel::ShardSpec* spec_of(const torch::Tensor& p) const {
    return placements ? placements->find(p) : nullptr;
  }
  // This rank's piece of parameter i, shaped as its box.
  torch::Tensor piece_of(size_t i) const {
    const auto* spec = spec_of(params[i].second);
    return params[i].second.detach().reshape(box_of(params[i].second, spec).size).contiguous();
  }
};

// This rank's pieces as rows [param index, offset x kMaxDims, size x kMaxDims]: what it tells rank 0 it sends.
std::vector<int64_t> piece_rows(const FinalWeights& w, int rank) {
  const auto& params = w.params;
  std::vector<int64_t> rows;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto* spec = w.spec_of(params[i].second);
    if (!owns(spec, rank)) continue;
    const parallel::Box b = box_of(params[i].second, spec);
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(b.size.size()) <= kMaxDims, params[i].first, " has over 8 dims");
    rows.push_back(static_cast<int64_t>(i));
    for (int64_t d = 0; d < kMaxDims; ++d) rows.push_back(d < static_cast<int64_t>(b.offset.size()) ? b.offset[d] : 0);
    for (int64_t d = 0; d < kMaxDims; ++d) rows.push_back(d < static_cast<int64_t>(b.size.size()) ? b.size[d] : 0);
  }
  return rows;
}

// A rank other than 0 sends rank 0 its row count, then its rows and its pieces in their order.
void send_pieces(const FinalWeights& w, parallel::Group& world, const std::vector<int64_t>& rows) {
  auto n = torch::tensor({static_cast<int64_t>(rows.size()) / kRowWidth}, torch::kLong);
  parallel::send(world, n, 0);
  if (rows.empty()) return;
  parallel::send(world, torch::tensor(rows, torch::kLong), 0);
  for (size_t k = 0; k < rows.size(); k += kRowWidth) {
    parallel::send(world, w.piece_of(static_cast<size_t>(rows[k])), 0);
  }
}

// Rank 0: every rank's rows (its own `rows`, the others' received in rank order), as the sources of each tensor.
Sources gather_sources(const FinalWeights& w, parallel::Group* world, int64_t world_size,
                       const std::vector<int64_t>& rows) {
  Sources sources(w.params.size());
  for (int r = 0; r < world_size; ++r) {
    torch::Tensor t = torch::tensor(rows, torch::kLong);
    if (r != 0) {
      auto n = torch::zeros({1}, torch::kLong);
      parallel::recv(*world, n, r);
      t = torch::empty({n.item<int64_t>() * kRowWidth}, torch::kLong);
      if (t.numel()) parallel::recv(*world, t, r);
    }
    const int64_t* v = t.data_ptr<int64_t>();
    for (int64_t k = 0; k < t.numel(); k += kRowWidth) {
      const auto& p = w.params.at(static_cast<size_t>(v[k])).second;
      const size_t dims = box_of(p, w.spec_of(p)).size.size();
      parallel::Box b{std::vector<int64_t>(v + k + 1, v + k + 1 + dims),
                      std::vector<int64_t>(v + k + 1 + kMaxDims, v + k + 1 + kMaxDims + dims)};
      sources[static_cast<size_t>(v[k])].emplace_back(r, std::move(b));
    }
  }
  return sources;
}

// Rank 0: writes each tensor to `path` once its pieces (its own, the others' received from `sources`) fill it.
void write_assembled(const FinalWeights& w, parallel::Group* world, const Sources& sources, const std::string& path) {
  const auto& params = w.params;
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, p] : params) {
    const auto* spec = w.spec_of(p);
    entries.push_back({name, spec ? spec->dtype : p.scalar_type(), global_shape(p, spec)});
  }
  SafetensorsWriter out(path, entries, {{"format", "pt"}});
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor full = torch::empty(entries[i].shape, torch::dtype(entries[i].dtype));
    int64_t covered = 0;
    for (const auto& [r, box] : sources[i]) {
      torch::Tensor piece;
      if (r == 0) {
        piece = w.piece_of(i);
      } else {
        piece = torch::empty(box.size, torch::dtype(entries[i].dtype));
        parallel::recv(*world, piece, r);
      }
      place(full, box, piece);
      covered += piece.numel();
    }
    TORCH_INTERNAL_ASSERT(covered == full.numel(), params[i].first, ": the owners' pieces cover ", covered, " of ",
                          full.numel(), " elements");
    out.write(full);
  }
  out.finish();
}

// One tensor `composer export` writes: a PyTorch name, the checkpoint key that
// holds it, and its shape; or (expert >= 0) slice `expert` of the key's dim 0
// (an expert's weight, stored one tensor per expert), `full` the key's shape.
struct Item {
  std::string name, key;
  std::vector<int64_t> shape;
  int64_t expert = -1;
  std::vector<int64_t> full;
};

// Refuses a checkpoint that another config saved.
void check_saved_by(const CheckpointReader& reader, const ExperimentConfig& c, const std::string& checkpoint) {
  if (reader.index().config_hash != config_hash(c)) {
    throw UserError("--checkpoint " + checkpoint +
                    " was saved by a config with another seed, model, train or data "
                    "section than --config " +
                    c.file + " (hash " + reader.index().config_hash + ", this config's " + config_hash(c) +
                    "); export it with the config that saved it");
  }
}

// The model's PyTorch names (tied weights under each), and the checkpoint key that holds each tensor.
std::vector<Item> model_items(const ExperimentConfig& c) {
  std::vector<Item> items;
  nn::ShapeOnly shapes;  // names and shapes only
  models::ModelPtr model = models::find_model(c.model.name)->build(c.model.args);
  attach_lora(*model, c.train.lora);
  std::map<const c10::TensorImpl*, std::string> key_of;
  for (auto& [name, p] : nn::unique_named_parameters(*model)) key_of.emplace(p.unsafeGetTensorImpl(), name);
  for (const auto& p : model->named_parameters(/*recurse=*/true)) {
    items.push_back({p.key(), key_of.at(p.value().unsafeGetTensorImpl()), p.value().sizes().vec()});
  }
  for (const auto& b : model->named_buffers()) items.push_back({b.key(), b.key(), b.value().sizes().vec()});
  return items;
}

// The name `source` holds each of the model's parameters and weight buffers under (WeightSource::match), by
// FQN; the parameters `drawn` names are not in it.
std::map<std::string, std::string> stored_names(const WeightSource& source, const ExperimentConfig& c,
                                                const std::function<bool(const std::string&)>& drawn = {}) {
  nn::ShapeOnly shapes;  // names and shapes only
  models::ModelPtr model = models::find_model(c.model.name)->build(c.model.args);
  attach_lora(*model, c.train.lora);
  const auto stored = source.match(*model, {}, drawn);
  std::map<std::string, std::string> out;
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    auto it = stored.find(t.unsafeGetTensorImpl());
    if (it != stored.end()) out[name] = it->second;
  };
  for (auto& [name, p] : nn::unique_named_parameters(*model)) add(name, p);
  for (auto& [name, b] : nn::named_weight_buffers(*model)) add(name, b);
  return out;
}

// Where exported tensors come from: a checkpoint (any plan) or a safetensors
// file in composer's names (a run's init or final weights).
class ExportSource {
 public:
  ExportSource(const ExperimentConfig& c, const ExportOptions& o) : model_name_(c.model.name) {
    if (!o.checkpoint.empty()) {
      if (!fs::exists(fs::path(o.checkpoint) / "index.json")) {
        throw UserError("--checkpoint " + o.checkpoint +
                        ": not a complete checkpoint (no index.json in it); give a step-N "
                        "folder that has one");
      }
      reader_ = std::make_unique<CheckpointReader>(o.checkpoint);
      check_saved_by(*reader_, c, o.checkpoint);
      what_ = "step " + std::to_string(reader_->index().step) + " of " + o.checkpoint;
      if (!reader_->index().frozen_base.is_null()) open_frozen_base(c, o.checkpoint);
      return;
    }
    weights_ = WeightSource::file(o.weights);
    stored_of_ = stored_names(*weights_, c);
    what_ = o.weights;
  }
  // The dtype the source holds `key` in; refuses a key it lacks.
  torch::ScalarType dtype(const std::string& key) const {
    if (frozen(key)) return frozen_dtype_;
    if (weights_ && !stored_of_.count(key)) {
      throw UserError(what_ + " holds no tensor '" + key + "' (a buffer weights files of older runs leave out); "
                      "export from a checkpoint (--checkpoint) instead");
    }
    if (weights_) return weights_->dtype(stored_of_.at(key));
    auto e = reader_->index().tensors.find(key);
    if (e == reader_->index().tensors.end()) {
      throw FileError(reader_->index_path(), "missing tensor '" + key + "' that model " + model_name_ + " needs");
    }
    return scalar_type_of_name(e->second.dtype, reader_->index_path());
  }
  // Item `it`'s tensor (the key whole, or one expert's slice of it) in `dtype`.
  torch::Tensor read(const Item& it, torch::ScalarType dtype) {
    if (frozen(it.key)) return read_frozen(it).to(dtype);
    if (it.expert >= 0) {  // the slice's box of the key: only its bytes are read
      std::vector<int64_t> offset(it.full.size(), 0), size = it.full;
      offset[0] = it.expert;
      size[0] = 1;
      if (weights_) return weights_->read_box(stored_of_.at(it.key), offset, size).view(it.shape);
      torch::Tensor t = torch::empty(size, torch::dtype(dtype));
      reader_->read_box(it.key, it.full, {offset, size}, t);
      return t.view(it.shape);
    }
    if (weights_) return weights_->read(stored_of_.at(it.key));
    torch::Tensor t = torch::empty(it.shape, torch::dtype(dtype));
    const std::vector<int64_t> box = it.shape.empty() ? std::vector<int64_t>{1} : it.shape;
    reader_->read_box(it.key, box, {std::vector<int64_t>(box.size(), 0), box}, t.view(box));
    return t;
  }
  const std::string& what() const { return what_; }

 private:
  std::string model_name_, what_;
  std::unique_ptr<CheckpointReader> reader_;
  std::unique_ptr<WeightSource> weights_;
  std::map<std::string, std::string> stored_of_;  // each parameter's name in weights_
  // A checkpoint of a train.freeze or train.lora run holds what trains; its frozen parameters are the
  // start's: read from model.from_hf or init_from (base_, each parameter's name there in base_stored_),
  // or drawn from the seed as the run drew them (drawn_), in train.dtype as the run held them.
  std::unique_ptr<WeightSource> base_;
  std::map<std::string, std::string> base_stored_;
  std::map<std::string, torch::Tensor> drawn_;
  torch::ScalarType frozen_dtype_ = torch::kFloat;

  bool frozen(const std::string& key) const {
    return reader_ && !reader_->index().tensors.count(key) && (base_stored_.count(key) || drawn_.count(key));
  }
  void open_frozen_base(const ExperimentConfig& c, const std::string& checkpoint) {
    check_frozen_base(c, checkpoint);
    frozen_dtype_ = scalar_type_of(c.train.dtype);
    base_ = WeightSource::open(c.model, c.train.lora);
    if (base_) {
      base_stored_ = stored_names(*base_, c, drawn_adapters(c));
      return;
    }
    torch::manual_seed(c.seed);  // a drawn base: the draws of the run's start (build_model's)
    models::ModelPtr model = models::find_model(c.model.name)->build(c.model.args);
    attach_lora(*model, c.train.lora);
    for (auto& [name, p] : nn::unique_named_parameters(*model)) drawn_[name] = p.detach().to(frozen_dtype_);
  }
  torch::Tensor read_frozen(const Item& it) const {
    torch::Tensor t = base_ ? base_->read(base_stored_.at(it.key)).to(frozen_dtype_) : drawn_.at(it.key);
    return it.expert >= 0 ? t.select(0, it.expert).reshape(it.shape) : t;
  }
};

// Each item's entry in the exported files, in the dtype the source holds it in.
std::vector<SafetensorsWriter::Entry> export_entries(const std::vector<Item>& items, const ExportSource& source) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& it : items) entries.push_back({it.name, source.dtype(it.key), it.shape});
  return entries;
}

// The bytes of the entries' data, all files together.
uint64_t total_bytes(const std::vector<SafetensorsWriter::Entry>& entries) {
  uint64_t total = 0;
  for (const auto& e : entries) {
    uint64_t n = c10::elementSize(e.dtype);
    for (int64_t s : e.shape) n *= static_cast<uint64_t>(s);
    total += n;
  }
  return total;
}

// Shards in order, each filled while the next tensor fits (a larger tensor gets one of its own).
std::vector<std::vector<size_t>> plan_shards(const std::vector<SafetensorsWriter::Entry>& entries,
                                             uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> shards(1);
  uint64_t filled = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const uint64_t n = static_cast<uint64_t>(c10::elementSize(entries[i].dtype)) *
                       static_cast<uint64_t>(c10::multiply_integers(entries[i].shape));
    if (!shards.back().empty() && filled + n > max_shard_bytes) {
      shards.emplace_back();
      filled = 0;
    }
    shards.back().push_back(i);
    filled += n;
  }
  return shards;
}

// The name of `out` less a .safetensors suffix: what shard files and their index are named after.
std::string shard_stem(const fs::path& out) {
  std::string stem = out.filename().string();
  if (stem.size() > 12 && stem.substr(stem.size() - 12) == ".safetensors") stem.resize(stem.size() - 12);
  return stem;
}

// The path of each of `count` shards: `out` for one, else <stem>-0000k-of-0000n.safetensors beside it.
std::vector<std::string> shard_names(const fs::path& out, const std::string& stem, size_t count) {
  std::vector<std::string> names;
  for (size_t s = 0; s < count; ++s) {
    char b[64];
    std::snprintf(b, sizeof b, "-%05zu-of-%05zu.safetensors", s + 1, count);
    names.push_back(count == 1 ? out.string() : (out.parent_path() / (stem + b)).string());
  }
  return names;
}

// Writes every shard, each tensor read whole from the source and passed
// through `convert`; returns the weight map (name to shard file).
nlohmann::ordered_json write_shards(ExportSource& source, const std::vector<Item>& items,
                                    const std::vector<SafetensorsWriter::Entry>& entries,
                                    const std::vector<std::vector<size_t>>& shards,
                                    const std::vector<std::string>& names,
                                    const std::function<torch::Tensor(const Item&, torch::Tensor)>& convert) {
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<SafetensorsWriter::Entry> mine;
    for (size_t i : shards[s]) mine.push_back(entries[i]);
    SafetensorsWriter w(names[s], mine, {{"format", "pt"}});
    for (size_t i : shards[s]) {
      w.write(convert(items[i], source.read(items[i], entries[i].dtype)));
      weight_map[entries[i].name] = fs::path(names[s]).filename().string();
    }
    w.finish();
  }
  return weight_map;
}

// Writes the index of a sharded export (Hugging Face's model.safetensors.index.json).
void write_shard_index(const std::string& index_path, uint64_t total, const nlohmann::ordered_json& weight_map) {
  nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::ofstream f(index_path);
  f << index.dump(2) << "\n";
  if (!f) throw RuntimeFailure("cannot write " + index_path);
}

}  // namespace

void write_final_weights(models::Model& model, const parallel::Placements* placements, parallel::Group* world, int rank,
                         const std::string& path) {
  torch::NoGradGuard no_grad;
  FinalWeights w{nn::unique_named_parameters(model), placements};
  for (auto& b : nn::named_weight_buffers(model)) w.params.push_back(std::move(b));  // placed as parameters are
  // Each rank's pieces as rows [param index, offset x kMaxDims, size x kMaxDims], sent to rank 0 first.
  const std::vector<int64_t> rows = piece_rows(w, rank);
  if (rank != 0) {
    send_pieces(w, *world, rows);
    return;
  }
  const int64_t world_size = world ? world->size : 1;
  write_assembled(w, world, gather_sources(w, world, world_size, rows), path);
}

uint64_t parse_byte_size(const std::string& text, const std::string& option) {
  static const std::pair<const char*, uint64_t> kUnits[] = {{"", 1},
                                                            {"B", 1},
                                                            {"KB", 1000},
                                                            {"MB", 1000000},
                                                            {"GB", 1000000000},
                                                            {"KiB", 1ull << 10},
                                                            {"MiB", 1ull << 20},
                                                            {"GiB", 1ull << 30}};
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string unit = text.substr(digits);
  for (const auto& [name, scale] : kUnits) {
    if (digits == 0 || digits > 15 || unit != name) continue;
    const uint64_t v = std::stoull(text.substr(0, digits)) * scale;
    if (v > 0) return v;
  }
  throw UserError(option + " " + text + ": expected a positive size such as 5GB, 500MB, 64KiB or a byte count");
}

// The model's adapter for --format hf: refuses a model without one, or
// arguments no Hugging Face architecture it writes computes.
const models::HfAdapter& hf_adapter(const ExperimentConfig& c) {
  const models::ModelSpec& spec = *models::find_model(c.model.name);
  if (!spec.hf) {
    throw UserError("composer export --format hf writes Hugging Face folders of model " +
                    models::listed_names_with(models::Capability::kHuggingFace) + "; model " + c.model.name +
                    " has no Hugging Face adapter; use --format pt");
  }
  hf_call("", [&] { spec.hf->check_export(c.model.args); });
  return *spec.hf;
}

// `items` under Hugging Face's names: a tied weight once, under the
// embedding's name; a weight stored one tensor per expert, expert by expert.
std::vector<Item> hf_items(const std::vector<Item>& items, const models::HfAdapter& hf, const models::ModelArgs& args) {
  std::vector<Item> renamed;
  for (const auto& it : items) {
    if (it.name != it.key) continue;
    if (hf.per_expert(it.name, args)) {
      for (int64_t j = 0; j < it.shape.at(0); ++j) {
        renamed.push_back({hf.hf_name(it.name, args, j), it.key,
                           std::vector<int64_t>(it.shape.begin() + 1, it.shape.end()), j, it.shape});
      }
      continue;
    }
    renamed.push_back(it);
    renamed.back().name = hf.hf_name(it.name, args);
    TORCH_INTERNAL_ASSERT(!renamed.back().name.empty(), "parameter ", it.name, " has no Hugging Face name");
  }
  return renamed;
}

// Writes the config.json of a model with `items` (by the model's names) beside its weights.
std::string write_hf_config(const ExperimentConfig& c, const models::HfAdapter& hf, const std::vector<Item>& items,
                            const std::string& out) {
  const auto shape = [&](const std::string& name) {
    for (const auto& it : items) {
      if (it.name == name) return it.shape;
    }
    TORCH_INTERNAL_ASSERT(false, "the model has no parameter ", name);
    return std::vector<int64_t>{};
  };
  const nlohmann::ordered_json j = hf.write_config(c.model.args, shape);
  const std::string config = (fs::path(out) / "config.json").string();
  std::ofstream f(config);
  f << j.dump(2) << "\n";
  if (!f) throw RuntimeFailure("cannot write " + config);
  return "wrote " + config + " (" + j.at("architectures").at(0).get<std::string>() + ")";
}

// --format peft: the adapters of a train.lora run as PEFT writes them (adapter_config.json and
// adapter_model.safetensors, keys base_model.model.<module>.lora_A.weight / lora_B.weight under the
// base's Hugging Face module names), the modules named exactly by a regular expression.
std::vector<std::string> export_peft(const ExperimentConfig& c, const ExportOptions& o) {
  const LoraConfig& l = *c.train.lora;
  const models::HfAdapter& hf = hf_adapter(c);
  ExportSource source(c, o);
  NamedTensors tensors;
  std::vector<std::string> modules;
  for (const auto& it : model_items(c)) {
    if (it.name != it.key || !is_lora_name(it.name)) continue;
    const bool b = it.name.back() == 'B';
    const std::string weight = hf.hf_name(lora_weight(it.name), c.model.args);
    TORCH_INTERNAL_ASSERT(weight.size() > 7 && weight.compare(weight.size() - 7, 7, ".weight") == 0, weight);
    const std::string module = weight.substr(0, weight.size() - 7);
    torch::Tensor t = source.read(it, source.dtype(it.key));
    const int64_t groups = b ? hf.row_groups(lora_weight(it.name), c.model.args) : 0;  // B's rows are the base's
    if (groups) t = hf.to_hf_rows(t, groups).contiguous();
    tensors.emplace_back("base_model.model." + module + (b ? ".lora_B.weight" : ".lora_A.weight"), t);
    if (!b) modules.push_back(module);
  }
  std::string pattern;
  for (const auto& m : modules) {
    std::string escaped;
    for (char ch : m) escaped += ch == '.' ? std::string("\\.") : std::string(1, ch);
    pattern += (pattern.empty() ? "" : "|") + escaped;
  }
  fs::create_directories(o.out);
  const std::string weights = (fs::path(o.out) / "adapter_model.safetensors").string();
  write_safetensors(weights, tensors, {{"format", "pt"}});
  nlohmann::ordered_json j = {{"peft_type", "LORA"},
                              {"task_type", "CAUSAL_LM"},
                              {"base_model_name_or_path", c.model.from_hf},
                              {"r", l.rank},
                              {"lora_alpha", l.alpha},
                              {"lora_dropout", l.dropout},
                              {"target_modules", pattern},
                              {"bias", "none"},
                              {"fan_in_fan_out", false},
                              {"use_rslora", false},
                              {"use_dora", false},
                              {"init_lora_weights", true},
                              {"inference_mode", true}};
  const std::string config = (fs::path(o.out) / "adapter_config.json").string();
  std::ofstream f(config);
  f << j.dump(2) << "\n";
  if (!f) throw RuntimeFailure("cannot write " + config);
  return {"exported the LoRA adapters of " + source.what() + ": " + std::to_string(modules.size()) +
              " layers, rank " + std::to_string(l.rank),
          "wrote " + weights, "wrote " + config + " (PEFT LORA)"};
}

// What a LoRA run may export: its adapters (peft) or, with --merge, the base with them added (pt, hf).
void check_lora_export(const ExperimentConfig& c, const ExportOptions& o) {
  if (o.format == ExportFormat::kPeft && !c.train.lora) {
    throw UserError("--format peft writes the LoRA adapters of a train.lora run; " + c.file +
                    " has no train.lora (use pt or hf)");
  }
  if (o.merge && (!c.train.lora || o.format == ExportFormat::kPeft)) {
    throw UserError(c.train.lora ? "--merge writes the base with the adapters added in (--format pt or hf); "
                                   "--format peft writes the adapters alone: leave out one of them"
                                 : "--merge adds a train.lora run's adapters into the base; " + c.file +
                                       " has no train.lora: leave --merge out");
  }
  if (c.train.lora && !o.merge && o.format != ExportFormat::kPeft) {
    throw ConfigError(c.train.lora->ref, "a LoRA run's weights export as its adapters, --format peft (a PEFT "
                                         "folder for the Hugging Face base), or merged into the base: add --merge");
  }
}

namespace {

// --merge: the adapted weights W + (alpha / rank) B A (float32, then W's dtype), the adapters left out.
class MergedAdapters {
 public:
  MergedAdapters(const ExperimentConfig& c, const std::vector<Item>& model) {
    if (!c.train.lora) return;
    scale_ = c.train.lora->alpha / static_cast<double>(c.train.lora->rank);
    for (const auto& it : model) {
      if (!is_lora_name(it.name)) continue;
      auto& [a, b] = adapters_[lora_weight(it.name)];
      (it.name.back() == 'A' ? a : b) = it;
    }
  }
  bool adapter(const Item& it) const { return is_lora_name(it.name) && adapters_.count(lora_weight(it.name)); }
  int64_t layers() const { return static_cast<int64_t>(adapters_.size()); }
  // Item `it`'s value: `w`, plus its layer's adapter if it has one.
  torch::Tensor operator()(ExportSource& source, const Item& it, const torch::Tensor& w) const {
    auto found = adapters_.find(it.key);
    if (it.expert >= 0 || found == adapters_.end()) return w;
    const auto& [a, b] = found->second;
    const torch::Tensor A = source.read(a, source.dtype(a.key)).to(torch::kFloat);
    const torch::Tensor B = source.read(b, source.dtype(b.key)).to(torch::kFloat);
    return (w.to(torch::kFloat) + torch::mm(B, A) * scale_).to(w.scalar_type());
  }

 private:
  double scale_ = 0;
  std::map<std::string, std::pair<Item, Item>> adapters_;  // by the adapted weight: lora_A's item, lora_B's
};

}  // namespace

std::vector<std::string> export_weights(const ExperimentConfig& c, const ExportOptions& o) {
  check_lora_export(c, o);
  if (o.format == ExportFormat::kPeft) return export_peft(c, o);
  const bool hf = o.format == ExportFormat::kHf;
  const models::HfAdapter* adapter = hf ? &hf_adapter(c) : nullptr;
  ExportSource source(c, o);
  const std::vector<Item> model = model_items(c);
  const MergedAdapters merged(c, model);
  std::vector<Item> base;
  for (const auto& it : model) {
    if (!merged.adapter(it)) base.push_back(it);
  }
  const std::vector<Item> items = hf ? hf_items(base, *adapter, c.model.args) : base;
  const std::vector<SafetensorsWriter::Entry> entries = export_entries(items, source);
  const uint64_t total = total_bytes(entries);
  const std::vector<std::vector<size_t>> shards = plan_shards(entries, o.max_shard_bytes);
  const fs::path out = hf ? fs::path(o.out) / "model.safetensors" : fs::path(o.out);
  const std::string stem = shard_stem(out);
  const std::vector<std::string> names = shard_names(out, stem, shards.size());
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
  const nlohmann::ordered_json weight_map =
      write_shards(source, items, entries, shards, names, [&](const Item& it, torch::Tensor t) {
        t = merged(source, it, t);  // in the model's row order, as the adapters are
        const int64_t groups = hf ? adapter->row_groups(it.key, c.model.args) : 0;
        return groups ? adapter->to_hf_rows(t, groups).contiguous() : t;
      });
  char line[300];
  std::snprintf(line, sizeof line, "exported %s: %zu tensors, %.3f MB", source.what().c_str(), entries.size(),
                total / 1e6);
  std::vector<std::string> report{line};
  if (merged.layers()) {
    report.push_back("merged the LoRA adapters of " + std::to_string(merged.layers()) + " layers into their weights");
  }
  if (hf) report.push_back(write_hf_config(c, *adapter, model, o.out));
  if (shards.size() == 1) {
    report.push_back("wrote " + out.string());
    return report;
  }
  const std::string index_path = (out.parent_path() / (stem + ".safetensors.index.json")).string();
  write_shard_index(index_path, total, weight_map);
  report.push_back("wrote " + std::to_string(shards.size()) + " shards of at most " +
                   std::to_string(o.max_shard_bytes) + " bytes and " + index_path);
  return report;
}

}  // namespace composer

#include "runner/checkpoint/export.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include "parallelisms/comm/collectives.h"
#include "runner/checkpoint/checkpoint_reader.h"
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

}  // namespace

void write_final_weights(models::Model& model, const parallel::Placements* placements, parallel::Group* world, int rank,
                         const std::string& path) {
  torch::NoGradGuard no_grad;
  const auto params = nn::unique_named_parameters(model);
  auto spec_of = [&](const torch::Tensor& p) { return placements ? placements->find(p) : nullptr; };
  // Each rank's pieces as rows [param index, offset x kMaxDims, size x kMaxDims], sent to rank 0 first.
  std::vector<int64_t> rows;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto* spec = spec_of(params[i].second);
    if (!owns(spec, rank)) continue;
    const parallel::Box b = box_of(params[i].second, spec);
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(b.size.size()) <= kMaxDims, params[i].first, " has over 8 dims");
    rows.push_back(static_cast<int64_t>(i));
    for (int64_t d = 0; d < kMaxDims; ++d) rows.push_back(d < static_cast<int64_t>(b.offset.size()) ? b.offset[d] : 0);
    for (int64_t d = 0; d < kMaxDims; ++d) rows.push_back(d < static_cast<int64_t>(b.size.size()) ? b.size[d] : 0);
  }
  const int64_t width = 1 + 2 * kMaxDims, world_size = world ? world->size : 1;
  auto piece_of = [&](size_t i) {
    const auto* spec = spec_of(params[i].second);
    return params[i].second.detach().reshape(box_of(params[i].second, spec).size).contiguous();
  };
  if (rank != 0) {
    auto n = torch::tensor({static_cast<int64_t>(rows.size()) / width}, torch::kLong);
    parallel::send(*world, n, 0);
    if (rows.empty()) return;
    parallel::send(*world, torch::tensor(rows, torch::kLong), 0);
    for (size_t k = 0; k < rows.size(); k += width) parallel::send(*world, piece_of(static_cast<size_t>(rows[k])), 0);
    return;
  }
  // Rank 0: who sends which box of each tensor, in rank order.
  std::vector<std::vector<std::pair<int, parallel::Box>>> sources(params.size());
  for (int r = 0; r < world_size; ++r) {
    torch::Tensor t = torch::tensor(rows, torch::kLong);
    if (r != 0) {
      auto n = torch::zeros({1}, torch::kLong);
      parallel::recv(*world, n, r);
      t = torch::empty({n.item<int64_t>() * width}, torch::kLong);
      if (t.numel()) parallel::recv(*world, t, r);
    }
    const int64_t* v = t.data_ptr<int64_t>();
    for (int64_t k = 0; k < t.numel(); k += width) {
      const auto& p = params.at(static_cast<size_t>(v[k])).second;
      const size_t dims = box_of(p, spec_of(p)).size.size();
      parallel::Box b{std::vector<int64_t>(v + k + 1, v + k + 1 + dims),
                      std::vector<int64_t>(v + k + 1 + kMaxDims, v + k + 1 + kMaxDims + dims)};
      sources[static_cast<size_t>(v[k])].emplace_back(r, std::move(b));
    }
  }
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& [name, p] : params) {
    const auto* spec = spec_of(p);
    entries.push_back({name, spec ? spec->dtype : p.scalar_type(), global_shape(p, spec)});
  }
  SafetensorsWriter out(path, entries, {{"format", "pt"}});
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor full = torch::empty(entries[i].shape, torch::dtype(entries[i].dtype));
    int64_t covered = 0;
    for (const auto& [r, box] : sources[i]) {
      torch::Tensor piece;
      if (r == 0) {
        piece = piece_of(i);
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

std::vector<std::string> export_checkpoint(const ExperimentConfig& c, const ExportOptions& o) {
  if (!fs::exists(fs::path(o.checkpoint) / "index.json")) {
    throw UserError("--checkpoint " + o.checkpoint +
                    ": not a complete checkpoint (no index.json in it); give a step-N "
                    "folder that has one");
  }
  CheckpointReader reader(o.checkpoint);
  if (reader.index().config_hash != config_hash(c)) {
    throw UserError("--checkpoint " + o.checkpoint +
                    " was saved by a config with another seed, model, train or data "
                    "section than --config " +
                    c.file + " (hash " + reader.index().config_hash + ", this config's " + config_hash(c) +
                    "); export it with the config that saved it");
  }
  // The model's PyTorch names (tied weights under each), and the checkpoint key that holds each tensor.
  struct Item {
    std::string name, key;
    std::vector<int64_t> shape;
  };
  std::vector<Item> items;
  {
    nn::ShapeOnly shapes;  // names and shapes only
    models::ModelPtr model = models::find_model(c.model.name)->build(c.model.args);
    std::map<const c10::TensorImpl*, std::string> key_of;
    for (auto& [name, p] : nn::unique_named_parameters(*model)) key_of.emplace(p.unsafeGetTensorImpl(), name);
    for (const auto& p : model->named_parameters(/*recurse=*/true)) {
      items.push_back({p.key(), key_of.at(p.value().unsafeGetTensorImpl()), p.value().sizes().vec()});
    }
    for (const auto& b : model->named_buffers()) items.push_back({b.key(), b.key(), b.value().sizes().vec()});
  }
  std::vector<SafetensorsWriter::Entry> entries;
  uint64_t total = 0;
  for (const auto& it : items) {
    auto e = reader.index().tensors.find(it.key);
    if (e == reader.index().tensors.end()) {
      throw FileError(reader.index_path(), "missing tensor '" + it.key + "' that model " + c.model.name + " needs");
    }
    entries.push_back({it.name, scalar_type_of_name(e->second.dtype, reader.index_path()), it.shape});
    uint64_t n = c10::elementSize(entries.back().dtype);
    for (int64_t s : it.shape) n *= static_cast<uint64_t>(s);
    total += n;
  }
  // Shards in order, each filled while the next tensor fits (a larger tensor gets one of its own).
  std::vector<std::vector<size_t>> shards(1);
  uint64_t filled = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const uint64_t n = static_cast<uint64_t>(c10::elementSize(entries[i].dtype)) *
                       static_cast<uint64_t>(c10::multiply_integers(entries[i].shape));
    if (!shards.back().empty() && filled + n > o.max_shard_bytes) {
      shards.emplace_back();
      filled = 0;
    }
    shards.back().push_back(i);
    filled += n;
  }
  const fs::path out(o.out);
  std::string stem = out.filename().string();
  if (stem.size() > 12 && stem.substr(stem.size() - 12) == ".safetensors") stem.resize(stem.size() - 12);
  std::vector<std::string> names;
  for (size_t s = 0; s < shards.size(); ++s) {
    char b[64];
    std::snprintf(b, sizeof b, "-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    names.push_back(shards.size() == 1 ? out.string() : (out.parent_path() / (stem + b)).string());
  }
  if (!out.parent_path().empty()) fs::create_directories(out.parent_path());
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    std::vector<SafetensorsWriter::Entry> mine;
    for (size_t i : shards[s]) mine.push_back(entries[i]);
    SafetensorsWriter w(names[s], mine, {{"format", "pt"}});
    for (size_t i : shards[s]) {
      torch::Tensor t = torch::empty(entries[i].shape, torch::dtype(entries[i].dtype));
      const std::vector<int64_t> box = entries[i].shape.empty() ? std::vector<int64_t>{1} : entries[i].shape;
      reader.read_box(items[i].key, box, {std::vector<int64_t>(box.size(), 0), box}, t.view(box));
      w.write(t);
      weight_map[entries[i].name] = fs::path(names[s]).filename().string();
    }
    w.finish();
  }
  char line[300];
  std::snprintf(line, sizeof line, "exported step %lld of %s: %zu tensors, %.3f MB",
                static_cast<long long>(reader.index().step), o.checkpoint.c_str(), entries.size(), total / 1e6);
  std::vector<std::string> report{line};
  if (shards.size() == 1) {
    report.push_back("wrote " + o.out);
    return report;
  }
  const std::string index_path = (out.parent_path() / (stem + ".safetensors.index.json")).string();
  nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::ofstream f(index_path);
  f << index.dump(2) << "\n";
  if (!f) throw RuntimeFailure("cannot write " + index_path);
  report.push_back("wrote " + std::to_string(shards.size()) + " shards of at most " +
                   std::to_string(o.max_shard_bytes) + " bytes and " + index_path);
  return report;
}

}  // namespace composer

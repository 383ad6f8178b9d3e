#include "runner/checkpoint_index.h"

#include "runner/errors.h"

namespace composer {
namespace {

std::vector<int64_t> int_list(const nlohmann::json& j, const std::string& what, const std::string& path) {
  if (!j.is_array()) throw FileError(path, what + " must be a list of integers");
  std::vector<int64_t> v;
  for (const auto& x : j) {
    if (!x.is_number_unsigned()) throw FileError(path, what + " must be a list of non-negative integers");
    v.push_back(x.get<int64_t>());
  }
  return v;
}

}  // namespace

CheckpointIndex parse_checkpoint_index(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("checkpoint index is not valid JSON: ") + e.what());
  }
  auto need = [&](const nlohmann::json& o, const char* key, const std::string& where) -> const nlohmann::json& {
    if (!o.is_object() || !o.contains(key)) throw FileError(path, where + " has no '" + key + "'");
    return o[key];
  };
  if (!j.is_object() || j.value("format", "") != "composer-checkpoint") {
    throw FileError(path, "not a composer checkpoint index (format is not composer-checkpoint)");
  }
  if (need(j, "version", "the index") != 1) throw FileError(path, "unsupported checkpoint version " + j["version"].dump());
  CheckpointIndex x;
  const auto& step = need(j, "step", "the index");
  const auto& world = need(j, "world_size", "the index");
  if (!step.is_number_unsigned() || !world.is_number_unsigned() || world.get<uint64_t>() == 0 ||
      world.get<uint64_t>() > (1u << 20)) {
    throw FileError(path, "step and world_size must be positive integers");
  }
  x.step = step.get<int64_t>();
  x.world_size = world.get<int64_t>();
  const auto& hash = need(j, "config_hash", "the index");
  if (!hash.is_string()) throw FileError(path, "config_hash must be a string");
  x.config_hash = hash.get<std::string>();
  x.plan = j.value("plan", nlohmann::json());
  const auto& files = need(j, "files", "the index");
  if (!files.is_array()) throw FileError(path, "files must be a list");
  for (const auto& f : files) {
    const auto& name = need(f, "name", "a file entry");
    const auto& h = need(f, "fnv1a64", "a file entry");
    if (!name.is_string() || !h.is_string()) throw FileError(path, "a file entry's name and fnv1a64 must be strings");
    const std::string n = name.get<std::string>();
    if (n.empty() || n.find('/') != std::string::npos || n[0] == '.') {
      throw FileError(path, "file name '" + n + "' must be a plain name inside the checkpoint folder");
    }
    x.file_hashes[n] = h.get<std::string>();
  }
  const auto& tensors = need(j, "tensors", "the index");
  if (!tensors.is_object()) throw FileError(path, "tensors must be an object");
  for (const auto& item : tensors.items()) {
    const std::string where = "tensor '" + item.key() + "'";
    CheckpointIndex::Entry e;
    const auto& dtype = need(item.value(), "dtype", where);
    if (!dtype.is_string()) throw FileError(path, where + ": dtype must be a string");
    e.dtype = dtype.get<std::string>();
    e.shape = int_list(need(item.value(), "shape", where), where + ": shape", path);
    const auto& chunks = need(item.value(), "chunks", where);
    if (!chunks.is_array() || chunks.empty()) throw FileError(path, where + ": chunks must be a non-empty list");
    for (const auto& ch : chunks) {
      CheckpointIndex::Chunk c;
      const auto& file = need(ch, "file", where + "'s chunk");
      if (!file.is_string() || !x.file_hashes.count(file.get<std::string>())) {
        throw FileError(path, where + ": a chunk names a file the index does not list");
      }
      c.file = file.get<std::string>();
      c.offset = int_list(need(ch, "offset", where + "'s chunk"), where + ": offset", path);
      c.size = int_list(need(ch, "size", where + "'s chunk"), where + ": size", path);
      if (c.offset.size() != e.shape.size() || c.size.size() != e.shape.size()) {
        throw FileError(path, where + ": a chunk's offset and size need one entry per dim of the shape");
      }
      for (size_t d = 0; d < e.shape.size(); ++d) {
        if (c.offset[d] > e.shape[d] || c.size[d] > e.shape[d] - c.offset[d]) {
          throw FileError(path, where + ": a chunk lies outside the tensor's shape");
        }
      }
      e.chunks.push_back(std::move(c));
    }
    x.tensors.emplace(item.key(), std::move(e));
  }
  return x;
}

}  // namespace composer

#include "runner/checkpoint/checkpoint_index.h"

#include <algorithm>
#include <cstdio>

#include "runner/base/errors.h"

namespace composer {

uint64_t fnv1a64(const char* data, size_t n, uint64_t h) {
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 0x100000001b3ull;
  return h;
}

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::vector<std::string> block_hashes(const char* data, size_t n, int64_t block) {
  std::vector<std::string> out;
  for (size_t at = 0; at < n; at += static_cast<size_t>(block)) {
    out.push_back(hex64(fnv1a64(data + at, std::min(n - at, static_cast<size_t>(block)))));
  }
  return out;
}

namespace {

std::vector<std::string> hash_list(const nlohmann::json& j, const std::string& what, const std::string& path) {
  if (!j.is_array()) throw FileError(path, what + " must be a list of hashes");
  std::vector<std::string> v;
  for (const auto& x : j) {
    if (!x.is_string()) throw FileError(path, what + " must be a list of hex strings");
    v.push_back(x.get<std::string>());
  }
  return v;
}

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
  if (need(j, "version", "the index") != 2) {
    throw FileError(path, "unsupported checkpoint version " + j["version"].dump() +
                              "; this composer reads version 2 (save it again with this composer)");
  }
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
  const auto& block = need(j, "hash_block_bytes", "the index");
  if (!block.is_number_unsigned() || block.get<uint64_t>() == 0 || block.get<uint64_t>() > (1ull << 40)) {
    throw FileError(path, "hash_block_bytes must be a positive integer");
  }
  x.hash_block_bytes = block.get<int64_t>();
  const auto& files = need(j, "files", "the index");
  if (!files.is_array()) throw FileError(path, "files must be a list");
  for (const auto& f : files) {
    const auto& name = need(f, "name", "a file entry");
    const auto& h = need(f, "fnv1a64", "a file entry");
    const auto& hh = need(f, "header_fnv1a64", "a file entry");
    if (!name.is_string() || !h.is_string() || !hh.is_string()) {
      throw FileError(path, "a file entry's name, fnv1a64 and header_fnv1a64 must be strings");
    }
    const std::string n = name.get<std::string>();
    if (n.empty() || n.find('/') != std::string::npos || n[0] == '.') {
      throw FileError(path, "file name '" + n + "' must be a plain name inside the checkpoint folder");
    }
    x.files[n] = {h.get<std::string>(), hh.get<std::string>(),
                  hash_list(need(f, "rng_fnv1a64", "a file entry"), "a file entry's rng_fnv1a64", path)};
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
      if (!file.is_string() || !x.files.count(file.get<std::string>())) {
        throw FileError(path, where + ": a chunk names a file the index does not list");
      }
      c.file = file.get<std::string>();
      c.offset = int_list(need(ch, "offset", where + "'s chunk"), where + ": offset", path);
      c.size = int_list(need(ch, "size", where + "'s chunk"), where + ": size", path);
      c.block_hashes = hash_list(need(ch, "fnv1a64", where + "'s chunk"), where + ": fnv1a64", path);
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

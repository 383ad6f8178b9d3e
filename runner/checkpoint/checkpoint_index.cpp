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

// Member `key` of object `o`; a FileError naming `where` it is missing from.
const nlohmann::json& need(const nlohmann::json& o, const char* key, const std::string& where,
                           const std::string& path) {
  if (!o.is_object() || !o.contains(key)) throw FileError(path, where + " has no '" + key + "'");
  return o[key];
}

// Reads the index's own fields (format, version, step, world size, config hash, plan, hash block size) into `x`.
void parse_index_fields(const nlohmann::json& j, const std::string& path, CheckpointIndex& x) {
  // json::value with a string default throws when the member is another type: compare the member itself.
  if (!j.is_object() || !j.contains("format") || j["format"] != "composer-checkpoint") {
    throw FileError(path, "not a composer checkpoint index (format is not composer-checkpoint)");
  }
  const auto& version = need(j, "version", "the index", path);
  if (version != 2 && version != 3) {
    throw FileError(path, "unsupported checkpoint version " + version.dump() +
                              "; this composer reads versions 2 and 3 (save it again with this composer)");
  }
  x.version = version.get<int>();
  const auto& step = need(j, "step", "the index", path);
  const auto& world = need(j, "world_size", "the index", path);
  if (!step.is_number_unsigned() || !world.is_number_unsigned() || world.get<uint64_t>() == 0 ||
      world.get<uint64_t>() > (1u << 20)) {
    throw FileError(path, "step and world_size must be positive integers");
  }
  x.step = step.get<int64_t>();
  x.world_size = world.get<int64_t>();
  const auto& hash = need(j, "config_hash", "the index", path);
  if (!hash.is_string()) throw FileError(path, "config_hash must be a string");
  x.config_hash = hash.get<std::string>();
  if (j.contains("resume_hash") && j["resume_hash"].is_string()) x.resume_hash = j["resume_hash"].get<std::string>();
  if (j.contains("train_steps") && j["train_steps"].is_number_unsigned()) x.train_steps = j["train_steps"].get<int64_t>();
  x.plan = j.value("plan", nlohmann::json());
  x.frozen_base = j.value("frozen_base", nlohmann::json());
  if (!x.frozen_base.is_null() && !x.frozen_base.is_object()) throw FileError(path, "frozen_base must be an object");
  const auto& block = need(j, "hash_block_bytes", "the index", path);
  if (!block.is_number_unsigned() || block.get<uint64_t>() == 0 || block.get<uint64_t>() > (1ull << 40)) {
    throw FileError(path, "hash_block_bytes must be a positive integer");
  }
  x.hash_block_bytes = block.get<int64_t>();
}

// Reads the index's list of rank files into x.files; each name must stay inside the checkpoint folder.
void parse_files(const nlohmann::json& files, const std::string& path, CheckpointIndex& x) {
  if (!files.is_array()) throw FileError(path, "files must be a list");
  for (const auto& f : files) {
    const auto& name = need(f, "name", "a file entry", path);
    const auto& h = need(f, "fnv1a64", "a file entry", path);
    const auto& hh = need(f, "header_fnv1a64", "a file entry", path);
    if (!name.is_string() || !h.is_string() || !hh.is_string()) {
      throw FileError(path, "a file entry's name, fnv1a64 and header_fnv1a64 must be strings");
    }
    const std::string n = name.get<std::string>();
    if (n.empty() || n.find('/') != std::string::npos || n[0] == '.') {
      throw FileError(path, "file name '" + n + "' must be a plain name inside the checkpoint folder");
    }
    x.files[n] = {h.get<std::string>(), hh.get<std::string>(),
                  hash_list(need(f, "rng_fnv1a64", "a file entry", path), "a file entry's rng_fnv1a64", path)};
  }
}

// One chunk of tensor `where` (of `shape`): in a file `files` lists, and inside the shape.
CheckpointIndex::Chunk parse_chunk(const nlohmann::json& ch, const std::string& where,
                                   const std::vector<int64_t>& shape,
                                   const std::map<std::string, CheckpointIndex::File>& files, const std::string& path) {
  CheckpointIndex::Chunk c;
  const auto& file = need(ch, "file", where + "'s chunk", path);
  if (!file.is_string() || !files.count(file.get<std::string>())) {
    throw FileError(path, where + ": a chunk names a file the index does not list");
  }
  c.file = file.get<std::string>();
  c.offset = int_list(need(ch, "offset", where + "'s chunk", path), where + ": offset", path);
  c.size = int_list(need(ch, "size", where + "'s chunk", path), where + ": size", path);
  c.block_hashes = hash_list(need(ch, "fnv1a64", where + "'s chunk", path), where + ": fnv1a64", path);
  if (c.offset.size() != shape.size() || c.size.size() != shape.size()) {
    throw FileError(path, where + ": a chunk's offset and size need one entry per dim of the shape");
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (c.offset[d] > shape[d] || c.size[d] > shape[d] - c.offset[d]) {
      throw FileError(path, where + ": a chunk lies outside the tensor's shape");
    }
  }
  return c;
}

// The entry of tensor `where` in the index: its dtype, shape and at least one chunk.
CheckpointIndex::Entry parse_tensor(const nlohmann::json& v, const std::string& where,
                                    const std::map<std::string, CheckpointIndex::File>& files,
                                    const std::string& path) {
  CheckpointIndex::Entry e;
  const auto& dtype = need(v, "dtype", where, path);
  if (!dtype.is_string()) throw FileError(path, where + ": dtype must be a string");
  e.dtype = dtype.get<std::string>();
  e.shape = int_list(need(v, "shape", where, path), where + ": shape", path);
  const auto& chunks = need(v, "chunks", where, path);
  if (!chunks.is_array() || chunks.empty()) throw FileError(path, where + ": chunks must be a non-empty list");
  for (const auto& ch : chunks) e.chunks.push_back(parse_chunk(ch, where, e.shape, files, path));
  return e;
}

}  // namespace

CheckpointIndex parse_checkpoint_index(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("checkpoint index is not valid JSON: ") + e.what());
  }
  CheckpointIndex x;
  parse_index_fields(j, path, x);
  parse_files(need(j, "files", "the index", path), path, x);
  const auto& tensors = need(j, "tensors", "the index", path);
  if (!tensors.is_object()) throw FileError(path, "tensors must be an object");
  for (const auto& item : tensors.items()) {
    CheckpointIndex::Entry e = parse_tensor(item.value(), "tensor '" + item.key() + "'", x.files, path);
    e.stored = item.key();
    // Version 2 named optimizer states optim.state.<fqn>.<name>; version 3 names them as torchtitan does.
    const std::string old_prefix = "optim.state.";
    const std::string key = x.version == 2 && item.key().rfind(old_prefix, 0) == 0
                                ? "optimizer.state." + item.key().substr(old_prefix.size())
                                : item.key();
    x.tensors.emplace(key, std::move(e));
  }
  return x;
}

}  // namespace composer

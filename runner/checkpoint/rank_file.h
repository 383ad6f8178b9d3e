// A rank's checkpoint file: what it holds (the pieces it owns and its RNG
// state as host tensors, with their places) and how it is written durably.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "runner/base/safetensors.h"

namespace composer {

// What this rank's checkpoint file holds: the pieces it owns and its RNG
// state as contiguous host tensors, with their places.
struct RankSnapshot {
  NamedTensors tensors;
  nlohmann::json offsets = nlohmann::json::object(), global = nlohmann::json::object();
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto& [k, t] : tensors) n += t.numel() * static_cast<int64_t>(t.element_size());
    return n;
  }
};

// What a rank reports of its written file.
struct WrittenFile {
  uint64_t hash = 0;  // fnv1a64 of the whole file
  int64_t bytes = 0;
};

// Pieces of bytes written one after the other (a file's header, then each
// tensor's bytes where it lies).
using Chunks = std::vector<std::pair<const char*, size_t>>;

// Writes `chunks` (or `bytes`) to `path` durably: a temporary file, fsync,
// rename, fsync of the folder. A write that fails (a full disk, a file-size
// limit) removes the temporary file and names the path and the bytes it
// needed: the checkpoint folder then has no index.json, so it is never taken
// for a complete one, and the previous checkpoint, which only a complete save
// prunes, stays.
void write_synced(const std::string& path, const Chunks& chunks);
void write_synced(const std::string& path, const std::string& bytes);

// Writes the snapshot as a rank's checkpoint file (durably): the header, with
// the places and block hashes as metadata, then each tensor's bytes from
// where it lies, never a copy of the whole file.
WrittenFile write_rank_file(const std::string& path, const RankSnapshot& s);

}  // namespace composer

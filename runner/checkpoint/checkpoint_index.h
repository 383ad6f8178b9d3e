// A distributed checkpoint's index.json (runner/checkpoint.h): what it holds,
// its strict reader, and the hashes it records. Every malformed index is a
// FileError naming the file.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace composer {

// The hashes of a checkpoint: FNV-1a 64 (hex) of each file, of each file's
// safetensors header, and of every kHashBlockBytes block of each stored
// tensor's bytes, so a reader that reads only some rows checks exactly the
// bytes it read.
constexpr int64_t kHashBlockBytes = 1 << 20;
uint64_t fnv1a64(const char* data, size_t n, uint64_t h = 0xcbf29ce484222325ull);
std::string hex64(uint64_t v);
std::vector<std::string> block_hashes(const char* data, size_t n, int64_t block = kHashBlockBytes);

// A parsed, validated index.json. Malformed indexes are FileErrors.
struct CheckpointIndex {
  struct Chunk {
    std::string file;
    std::vector<int64_t> offset, size;
    std::vector<std::string> block_hashes;  // of the stored bytes, per hash block
  };
  struct Entry {
    std::string stored;  // its name in the rank files (a version 2 index's optimizer states keep their old names)
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<Chunk> chunks;
  };
  struct File {
    std::string hash;                    // the whole file's
    std::string header_hash;             // its safetensors header's (the JSON bytes)
    std::vector<std::string> rng_hashes;  // its rng tensor's blocks
  };
  int version = 3;
  int64_t step = 0;
  int64_t world_size = 1;
  int64_t hash_block_bytes = kHashBlockBytes;
  std::string config_hash;
  std::string resume_hash;  // config_hash without train.steps ("" in older checkpoints)
  int64_t train_steps = 0;  // the saving config's train.steps (0 in older checkpoints)
  nlohmann::json plan;
  // A run with frozen parameters (train.freeze, train.lora) saves only what trains; this says where the
  // frozen ones come from (frozen_base in runner/checkpoint/checkpoint.h). Null: every parameter is saved.
  nlohmann::json frozen_base;
  std::map<std::string, File> files;
  std::map<std::string, Entry> tensors;
};
CheckpointIndex parse_checkpoint_index(const std::string& text, const std::string& path);

}  // namespace composer

// A distributed checkpoint's index.json (runner/checkpoint.h): what it holds
// and its strict reader. Every malformed index is a FileError naming the file.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace composer {

// A parsed, validated index.json. Malformed indexes are FileErrors.
struct CheckpointIndex {
  struct Chunk {
    std::string file;
    std::vector<int64_t> offset, size;
  };
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<Chunk> chunks;
  };
  int64_t step = 0;
  int64_t world_size = 1;
  std::string config_hash;
  nlohmann::json plan;
  std::map<std::string, std::string> file_hashes;  // file -> fnv1a64 hex
  std::map<std::string, Entry> tensors;
};
CheckpointIndex parse_checkpoint_index(const std::string& text, const std::string& path);

}  // namespace composer

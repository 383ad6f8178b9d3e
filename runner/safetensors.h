// Reading and writing the safetensors format (8-byte little-endian header
// length, JSON header, raw little-endian data), so weights move between
// composer and PyTorch unchanged. Every malformed file is a FileError.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace composer {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Reads every tensor; validates the header, dtypes, shapes and offsets.
NamedTensors read_safetensors(const std::string& path);

// The header of `path` (the JSON object: each tensor's dtype, shape and
// data_offsets, and __metadata__), without reading the data.
nlohmann::json read_safetensors_header(const std::string& path);

// Parses an in-memory file (`path` only names it in errors).
NamedTensors parse_safetensors(const std::string& bytes, const std::string& path);

// Writes atomically (a temporary file renamed into place); tensors are made
// contiguous CPU copies. `metadata` goes into the header's __metadata__.
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Serialises to bytes (what write_safetensors writes).
std::string serialize_safetensors(const NamedTensors& tensors,
                                  const std::map<std::string, std::string>& metadata = {});

}  // namespace composer

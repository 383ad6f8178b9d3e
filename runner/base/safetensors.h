// Reading and writing the safetensors format (8-byte little-endian header
// length, JSON header, raw little-endian data), so weights move between
// composer and PyTorch unchanged. Every malformed file is a FileError.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace composer {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Reads every tensor; validates the header, dtypes, shapes and offsets.
NamedTensors read_safetensors(const std::string& path);

// Every tensor's entry in `path`'s header, checked as read_safetensors checks
// it (dtype, shape and offsets agree and lie inside the file), reading no data.
struct SafetensorsEntry {
  std::string name;
  torch::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};
std::vector<SafetensorsEntry> read_safetensors_entries(const std::string& path);

// The tensor of `entry` (one of read_safetensors_entries(path)), reading only its bytes.
torch::Tensor read_safetensors_tensor(const std::string& path, const SafetensorsEntry& entry);

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

// The safetensors name of a dtype ("F32") and back; an unsupported one is a
// UserError (a FileError naming `path` when reading).
const char* safetensors_dtype(torch::ScalarType t);
torch::ScalarType scalar_type_of_name(const std::string& name, const std::string& path);

// Writes a safetensors file one tensor at a time, so that a writer holds one
// tensor, never the whole set: the header is written first from every
// tensor's name, dtype and shape, then each tensor's bytes in that order (or
// in any order, by index). The bytes equal write_safetensors' for the same
// tensors; the file appears under `path` (renamed from a temporary name) at
// finish(), once every tensor is written.
class SafetensorsWriter {
 public:
  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(std::string path, const std::vector<Entry>& entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  // The next entry's tensor (its dtype and shape must match), or entry `index`'s.
  void write(const torch::Tensor& t) { write(next_, t); }
  void write(size_t index, const torch::Tensor& t);
  void finish();
  // Bytes the file has (header included).
  uint64_t size() const { return size_; }

 private:
  std::string path_;
  std::vector<Entry> entries_;
  std::vector<uint64_t> offsets_;  // of each entry's bytes in the file
  std::vector<char> written_;
  size_t next_ = 0, count_ = 0;
  uint64_t size_ = 0;
  std::FILE* out_ = nullptr;
};

// The header (its length in front, padded to 8 bytes) of tensors of these
// dtypes and shapes laid out in order: the first bytes of their file.
std::string header_bytes(const std::vector<SafetensorsWriter::Entry>& entries,
                         const std::map<std::string, std::string>& metadata);

}  // namespace composer

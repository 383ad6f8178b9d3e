#include "runner/base/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "runner/base/errors.h"

namespace composer {
namespace {

struct DTypeName {
  torch::ScalarType type;
  const char* name;
};
const DTypeName kDTypes[] = {{torch::kFloat, "F32"}, {torch::kDouble, "F64"}, {torch::kBFloat16, "BF16"},
                             {torch::kHalf, "F16"},  {torch::kLong, "I64"},   {torch::kInt, "I32"},
                             {torch::kShort, "I16"}, {torch::kChar, "I8"},    {torch::kByte, "U8"},
                             {torch::kBool, "BOOL"}};

constexpr uint64_t kMaxHeader = 100u << 20;  // 100 MiB, as the reference implementation

}  // namespace

std::string header_bytes(const std::vector<SafetensorsWriter::Entry>& entries,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    uint64_t n = c10::elementSize(e.dtype);
    for (int64_t s : e.shape) n *= static_cast<uint64_t>(s);
    header[e.name] = {{"dtype", safetensors_dtype(e.dtype)}, {"shape", e.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  std::string out(8, '\0');
  uint64_t len = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + h;
}

namespace {

// The length of the JSON header of the safetensors file `bytes`; refuses one longer than the file.
uint64_t header_length(const std::string& bytes, const std::string& path) {
  if (bytes.size() < 8) {
    throw FileError(path, "not a safetensors file: " + std::to_string(bytes.size()) +
                              " bytes, shorter than the 8-byte header length");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  if (header_len > kMaxHeader || header_len > bytes.size() - 8) {
    throw FileError(path, "safetensors header claims " + std::to_string(header_len) + " bytes but the file has " +
                              std::to_string(bytes.size() - 8) +
                              " after the length; the file is truncated or not safetensors");
  }
  return header_len;
}

// The JSON header of the safetensors file `bytes`, which must be an object.
nlohmann::json parse_header(const std::string& bytes, uint64_t header_len, const std::string& path) {
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, header_len));
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("safetensors header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) throw FileError(path, "safetensors header must be a JSON object");
  return header;
}

// The dtype a header entry's `dtype` names; null when it names none safetensors files here may hold.
const DTypeName* dtype_named(const nlohmann::json& dt) {
  const DTypeName* d = nullptr;
  for (const auto& cand : kDTypes) {
    if (dt.is_string() && dt.get<std::string>() == cand.name) d = &cand;
  }
  return d;
}

// Tensor `name`'s header `entry` checked against a data section of `data_len`
// bytes: refuses an entry whose dtype, shape and offsets do not agree or lie
// outside the data section.
SafetensorsEntry entry_of(const std::string& name, const nlohmann::json& entry, uint64_t data_len,
                          const std::string& path) {
  auto bad = [&](const std::string& why) { return FileError(path, "tensor '" + name + "': " + why); };
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets")) {
    throw bad("header entry needs dtype, shape and data_offsets");
  }
  const auto& dt = entry["dtype"];
  const DTypeName* d = dtype_named(dt);
  if (!d) throw bad("unsupported dtype " + dt.dump());
  std::vector<int64_t> shape;
  uint64_t numel = 1;
  if (!entry["shape"].is_array()) throw bad("shape must be a list of sizes");
  for (const auto& s : entry["shape"]) {
    if (!s.is_number_unsigned()) throw bad("shape has a negative or non-integer size");
    shape.push_back(s.get<int64_t>());
    if (__builtin_mul_overflow(numel, s.get<uint64_t>(), &numel) || numel > data_len) {
      if (s.get<uint64_t>() != 0) throw bad("shape is larger than the file's data section");
    }
  }
  const auto& off = entry["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
    throw bad("data_offsets must be [begin, end]");
  }
  uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  uint64_t elem = c10::elementSize(d->type);
  if (end < begin || end > data_len) {
    throw bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] lie outside the " +
              std::to_string(data_len) + "-byte data section; the file is truncated or its header lies");
  }
  if (end - begin != numel * elem) {
    throw bad("shape and dtype need " + std::to_string(numel * elem) + " bytes but data_offsets give " +
              std::to_string(end - begin));
  }
  return {name, d->type, shape, begin, end};
}

// Tensor `name` from its header `entry` and the file's data section (`data_len` bytes at `data`).
torch::Tensor tensor_of_entry(const std::string& name, const nlohmann::json& entry, const char* data, uint64_t data_len,
                              const std::string& path) {
  const SafetensorsEntry e = entry_of(name, entry, data_len, path);
  auto t = torch::empty(e.shape, torch::dtype(e.dtype));
  if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
  return t;
}

}  // namespace

const char* safetensors_dtype(torch::ScalarType t) {
  for (const auto& d : kDTypes) {
    if (d.type == t) return d.name;
  }
  throw UserError(std::string("safetensors cannot store dtype ") + c10::toString(t));
}

torch::ScalarType scalar_type_of_name(const std::string& name, const std::string& path) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return d.type;
  }
  throw FileError(path, "unsupported safetensors dtype " + name);
}

NamedTensors parse_safetensors(const std::string& bytes, const std::string& path) {
  const uint64_t header_len = header_length(bytes, path);
  const nlohmann::json header = parse_header(bytes, header_len, path);
  const uint64_t data_start = 8 + header_len, data_len = bytes.size() - data_start;
  NamedTensors out;
  for (const auto& item : header.items()) {
    const std::string& name = item.key();
    if (name == "__metadata__") continue;
    out.emplace_back(name, tensor_of_entry(name, item.value(), bytes.data() + data_start, data_len, path));
  }
  return out;
}

nlohmann::json read_safetensors_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot open the safetensors file; check the path");
  unsigned char len[8] = {};
  if (!in.read(reinterpret_cast<char*>(len), 8)) throw FileError(path, "not a safetensors file: shorter than 8 bytes");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len[i];
  if (header_len > kMaxHeader) throw FileError(path, "safetensors header claims " + std::to_string(header_len) + " bytes");
  std::string header(header_len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_len))) {
    throw FileError(path, "the safetensors header is truncated");
  }
  try {
    auto j = nlohmann::json::parse(header);
    if (!j.is_object()) throw FileError(path, "safetensors header must be a JSON object");
    return j;
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("safetensors header is not valid JSON: ") + e.what());
  }
}

std::vector<SafetensorsEntry> read_safetensors_entries(const std::string& path) {
  const nlohmann::json header = read_safetensors_header(path);  // checks the length and the JSON
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  unsigned char len[8] = {};
  in.seekg(0);
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len[i];
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_len = size > data_start ? size - data_start : 0;
  std::vector<SafetensorsEntry> out;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") continue;
    out.push_back(entry_of(item.key(), item.value(), data_len, path));
  }
  return out;
}

torch::Tensor read_safetensors_tensor(const std::string& path, const SafetensorsEntry& entry) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot open the safetensors file; check the path");
  unsigned char len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len[i];
  torch::Tensor t = torch::empty(entry.shape, torch::dtype(entry.dtype));
  in.seekg(static_cast<std::streamoff>(8 + header_len + entry.begin));
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(entry.end - entry.begin));
  if (!in) throw FileError(path, "cannot read tensor '" + entry.name + "'; the file is truncated");
  return t;
}

NamedTensors read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot open the safetensors file; check the path");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_safetensors(ss.str(), path);
}

std::string serialize_safetensors(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  std::vector<torch::Tensor> data;
  for (const auto& [name, t] : tensors) {
    data.push_back(t.detach().to(torch::kCPU).contiguous());
    entries.push_back({name, data.back().scalar_type(), data.back().sizes().vec()});
  }
  std::string out = header_bytes(entries, metadata);
  for (const auto& c : data) out.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  return out;
}

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<Entry>& entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), entries_(entries) {
  const std::string tmp = path_ + ".tmp";
  out_ = std::fopen(tmp.c_str(), "wb");
  if (!out_) throw RuntimeFailure("cannot write " + tmp);
  const std::string h = header_bytes(entries_, metadata);
  if (std::fwrite(h.data(), 1, h.size(), out_) != h.size()) throw RuntimeFailure("cannot write " + tmp);
  size_ = h.size();
  for (const auto& e : entries_) {
    uint64_t n = c10::elementSize(e.dtype);
    for (int64_t s : e.shape) n *= static_cast<uint64_t>(s);
    offsets_.push_back(size_);
    size_ += n;
  }
  size_ = h.size();
  written_.assign(entries_.size(), 0);
}

SafetensorsWriter::~SafetensorsWriter() {
  if (out_) std::fclose(out_);
}

void SafetensorsWriter::write(size_t index, const torch::Tensor& t) {
  TORCH_INTERNAL_ASSERT(index < entries_.size(), "more tensors than the header of ", path_, " lists");
  TORCH_INTERNAL_ASSERT(!written_[index], entries_[index].name, " is written twice to ", path_);
  const Entry& e = entries_[index];
  auto c = t.detach().to(torch::kCPU).contiguous();
  TORCH_INTERNAL_ASSERT(c.scalar_type() == e.dtype && c.sizes().vec() == e.shape, e.name, " is ", c.sizes(), " ",
                        c.scalar_type(), " but the header says ", c10::IntArrayRef(e.shape), " ", e.dtype);
  const size_t n = c.numel() * c.element_size();
  if (index != next_ && fseeko(out_, static_cast<off_t>(offsets_[index]), SEEK_SET) != 0) {
    throw RuntimeFailure("cannot seek in " + path_ + ".tmp");
  }
  if (n && std::fwrite(c.data_ptr(), 1, n, out_) != n) throw RuntimeFailure("cannot write " + path_ + ".tmp");
  size_ += n;
  written_[index] = 1;
  next_ = index + 1;
  ++count_;
}

void SafetensorsWriter::finish() {
  TORCH_INTERNAL_ASSERT(count_ == entries_.size(), path_, ": ", entries_.size() - count_, " tensors not written");
  const bool ok = std::fclose(out_) == 0;
  out_ = nullptr;
  if (!ok) throw RuntimeFailure("cannot write " + path_ + ".tmp (disk full?)");
  const std::string tmp = path_ + ".tmp";
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) throw RuntimeFailure("cannot rename " + tmp + " to " + path_);
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::string bytes = serialize_safetensors(tensors, metadata);
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw RuntimeFailure("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw RuntimeFailure("cannot rename " + tmp + " to " + path);
}

}  // namespace composer

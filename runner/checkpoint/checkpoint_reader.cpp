#include "runner/checkpoint/checkpoint_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "runner/base/errors.h"
#include "runner/base/safetensors.h"

namespace composer {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(path, "cannot read the file");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// `n` bytes at `offset`, or a FileError saying the file is shorter.
std::string pread_exact(int fd, const std::string& path, uint64_t offset, uint64_t n) {
  std::string out(n, '\0');
  uint64_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, out.data() + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0) throw FileError(path, std::string("cannot read: ") + std::strerror(errno));
    if (r == 0) {
      throw FileError(path, "the file ends at byte " + std::to_string(offset + got) +
                                " but index.json records data up "
                                "to byte " +
                                std::to_string(offset + n) + ": it is truncated");
    }
    got += static_cast<uint64_t>(r);
  }
  return out;
}

}  // namespace

CheckpointReader::CheckpointReader(std::string folder)
    : folder_(std::move(folder)), index_path_((std::filesystem::path(folder_) / "index.json").string()) {
  index_ = parse_checkpoint_index(read_text(index_path_), index_path_);
}

CheckpointReader::~CheckpointReader() {
  for (auto& [name, f] : files_) ::close(f.fd);
}

CheckpointReader::File& CheckpointReader::open(const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return it->second;
  File f;
  f.path = (std::filesystem::path(folder_) / name).string();
  f.fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0)
    throw FileError(f.path, "cannot open a rank file index.json lists: " + std::string(std::strerror(errno)));
  try {
    const std::string len = pread_exact(f.fd, f.path, 0, 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(len[i]);
    if (n > (100u << 20)) throw FileError(f.path, "safetensors header claims " + std::to_string(n) + " bytes");
    const std::string header = pread_exact(f.fd, f.path, 8, n);
    bytes_read_ += static_cast<int64_t>(8 + n);
    if (hex64(fnv1a64(header.data(), header.size())) != index_.files.at(name).header_hash) {
      throw FileError(f.path,
                      "its header's hash differs from the one index.json records: the file is damaged or was "
                      "replaced");
    }
    f.header = nlohmann::json::parse(header);
    f.data_start = 8 + n;
  } catch (...) {
    ::close(f.fd);
    throw;
  }
  return files_.emplace(name, std::move(f)).first->second;
}

std::string CheckpointReader::read_range(File& f, const std::string& name, uint64_t begin, uint64_t end,
                                         const std::vector<std::string>& hashes) {
  const auto& e = f.header.contains(name) ? f.header[name] : nlohmann::json();
  if (!e.is_object() || !e.contains("data_offsets")) throw FileError(f.path, "has no tensor '" + name + "'");
  const uint64_t t0 = e["data_offsets"][0].get<uint64_t>(), t1 = e["data_offsets"][1].get<uint64_t>();
  const uint64_t block = static_cast<uint64_t>(index_.hash_block_bytes), nbytes = t1 - t0;
  if (hashes.size() != (nbytes + block - 1) / block) {
    throw FileError(index_path_, "'" + name + "' in " + f.path + " has " + std::to_string(hashes.size()) +
                                     " block hashes for its " + std::to_string(nbytes) + " bytes");
  }
  const uint64_t b0 = begin / block, b1 = (end + block - 1) / block;
  const uint64_t from = b0 * block, to = std::min(b1 * block, nbytes);
  std::string bytes = pread_exact(f.fd, f.path, f.data_start + t0 + from, to - from);
  bytes_read_ += static_cast<int64_t>(bytes.size());
  for (uint64_t b = b0; b < b1; ++b) {
    const uint64_t at = (b - b0) * block, n = std::min(block, to - b * block);
    if (hex64(fnv1a64(bytes.data() + at, n)) != hashes[b]) {
      throw FileError(f.path, "the bytes of '" + name + "' (block " + std::to_string(b) +
                                  ") differ from the hash index.json records: the file is damaged or was replaced");
    }
  }
  return bytes.substr(begin - from, end - begin);
}

void CheckpointReader::read_box(const std::string& key, const std::vector<int64_t>& global, const parallel::Box& box,
                                torch::Tensor dst) {
  auto it = index_.tensors.find(key);
  if (it == index_.tensors.end()) {
    throw FileError(index_path_, "missing tensor '" + key + "' that the model or optimizer needs");
  }
  const auto& e = it->second;
  if (e.shape != global) {
    throw FileError(index_path_,
                    "tensor '" + key + "' has shape " + c10::str(e.shape) + " but the model's is " + c10::str(global));
  }
  const size_t dims = e.shape.size();
  int64_t covered = 0, need = 1;
  for (int64_t s : box.size) need *= s;
  torch::NoGradGuard no_grad;
  for (const auto& ch : e.chunks) {
    std::vector<int64_t> lo(dims), hi(dims);
    int64_t n = 1;
    for (size_t d = 0; d < dims; ++d) {
      lo[d] = std::max(box.offset[d], ch.offset[d]);
      hi[d] = std::min(box.offset[d] + box.size[d], ch.offset[d] + ch.size[d]);
      n *= std::max<int64_t>(0, hi[d] - lo[d]);
    }
    if (n == 0) continue;
    File& f = open(ch.file);
    const std::string& stored = e.stored;
    const auto& h = f.header.contains(stored) ? f.header[stored] : nlohmann::json();
    // Members compared as JSON values: json::value with a typed default throws on a member of another type.
    if (!h.is_object() || !h.contains("shape") || h["shape"] != nlohmann::json(ch.size) || !h.contains("dtype") ||
        h["dtype"] != e.dtype) {
      throw FileError(f.path, "has no tensor '" + key + "' of the dtype and size index.json records");
    }
    const torch::ScalarType type = scalar_type_of_name(e.dtype, f.path);
    // The chunk's rows [r0, r1) on dim 0 cover the overlap: one contiguous range.
    int64_t row = c10::elementSize(type);
    for (size_t d = 1; d < dims; ++d) row *= ch.size[d];
    const int64_t r0 = lo[0] - ch.offset[0], r1 = hi[0] - ch.offset[0];
    const std::string bytes =
        read_range(f, stored, static_cast<uint64_t>(r0 * row), static_cast<uint64_t>(r1 * row), ch.block_hashes);
    std::vector<int64_t> rows_shape = ch.size;
    rows_shape[0] = r1 - r0;
    torch::Tensor src = torch::empty(rows_shape, torch::dtype(type));
    std::memcpy(src.data_ptr(), bytes.data(), bytes.size());
    torch::Tensor out = dst;
    for (size_t d = 0; d < dims; ++d) {
      const int64_t src_lo = d == 0 ? 0 : lo[d] - ch.offset[d];
      out = out.narrow(static_cast<int64_t>(d), lo[d] - box.offset[d], hi[d] - lo[d]);
      src = src.narrow(static_cast<int64_t>(d), src_lo, hi[d] - lo[d]);
    }
    out.copy_(src);
    covered += n;
  }
  if (covered != need) {
    throw FileError(index_path_, "the chunks of '" + key + "' cover " + std::to_string(covered) + " of the " +
                                     std::to_string(need) + " elements asked for");
  }
}

torch::Tensor CheckpointReader::read_rng(const std::string& file) {
  auto it = index_.files.find(file);
  if (it == index_.files.end()) throw FileError(index_path_, "lists no file " + file);
  File& f = open(file);
  const auto& h = f.header.contains("rng") ? f.header["rng"] : nlohmann::json();
  if (!h.is_object() || !h.contains("dtype") || h["dtype"] != "U8" || !h.contains("shape") || !h["shape"].is_array() ||
      h["shape"].size() != 1) {
    throw FileError(f.path, "has no rng state (a 1-D U8 tensor named rng)");
  }
  const int64_t n = h["shape"][0].get<int64_t>();
  const std::string bytes = read_range(f, "rng", 0, static_cast<uint64_t>(n), it->second.rng_hashes);
  torch::Tensor t = torch::empty({n}, torch::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

}  // namespace composer

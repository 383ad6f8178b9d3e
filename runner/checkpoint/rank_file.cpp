#include "runner/checkpoint/rank_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "runner/base/errors.h"
#include "runner/checkpoint/checkpoint_index.h"

namespace composer {

namespace fs = std::filesystem;

namespace {

void fsync_path(const std::string& path, int flags) {
  const int fd = open(path.c_str(), flags | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}


}  // namespace

void write_synced(const std::string& path, const Chunks& chunks) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw RuntimeFailure("cannot create " + tmp + ": " + std::strerror(errno) +
                         "; make checkpoint.dir a folder this job can write");
  }
  size_t total = 0, done = 0;
  for (const auto& c : chunks) total += c.second;
  int err = 0;
  for (const auto& [data, size] : chunks) {
    size_t off = 0;
    while (off < size && !err) {
      const ssize_t n = ::write(fd, data + off, size - off);
      if (n > 0) off += static_cast<size_t>(n), done += static_cast<size_t>(n);
      else if (n < 0 && errno != EINTR) err = errno;
      else if (n == 0) err = ENOSPC;
    }
  }
  if (!err && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  if (err) {
    ::unlink(tmp.c_str());
    throw RuntimeFailure("cannot write " + path + ": " + std::strerror(err) + " after " + std::to_string(done) +
                         " of the " + std::to_string(total) + " bytes it needs; free space (or raise the "
                         "file-size limit) where checkpoint.dir points, or point it at a larger disk. The previous "
                         "checkpoint is intact and resumes");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw RuntimeFailure("cannot rename " + tmp + " to " + path);
  fsync_path(fs::path(path).parent_path().string(), O_RDONLY | O_DIRECTORY);
}

void write_synced(const std::string& path, const std::string& bytes) { write_synced(path, {{bytes.data(), bytes.size()}}); }

WrittenFile write_rank_file(const std::string& path, const RankSnapshot& s) {
  nlohmann::json hashes = nlohmann::json::object();  // per tensor, of each hash block of its bytes
  std::vector<SafetensorsWriter::Entry> entries;
  Chunks chunks(1);
  for (const auto& [key, t] : s.tensors) {
    const char* data = static_cast<const char*>(t.data_ptr());
    const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
    hashes[key] = block_hashes(data, n);
    entries.push_back({key, t.scalar_type(), t.sizes().vec()});
    chunks.emplace_back(data, n);
  }
  // PyTorch's HuggingFaceStorageReader takes each tensor of a file with this entry as the
  // chunk at its saved_offsets (torch/distributed/checkpoint/_hf_utils.py), so dcp.load reads a step folder.
  nlohmann::json sharding = nlohmann::json::object();
  for (const auto& [key, offset] : s.offsets.items()) sharding[key] = {{"saved_offsets", offset}};
  const std::string header = header_bytes(entries, {{"format", "composer-checkpoint-rank"},
                                                    {"offsets", s.offsets.dump()},
                                                    {"global_shapes", s.global.dump()},
                                                    {"fnv1a64", hashes.dump()},
                                                    {"DCP_SHARDING_INFO", sharding.dump()},
                                                    {"DCP_VERSION", "1.0"}});
  chunks[0] = {header.data(), header.size()};
  WrittenFile w;
  w.hash = fnv1a64(header.data(), header.size());
  w.bytes = static_cast<int64_t>(header.size());
  for (size_t i = 1; i < chunks.size(); ++i) {
    w.hash = fnv1a64(chunks[i].first, chunks[i].second, w.hash);
    w.bytes += static_cast<int64_t>(chunks[i].second);
  }
  write_synced(path, chunks);
  return w;
}

}  // namespace composer

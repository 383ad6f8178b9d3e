// TensorBoard event files: Event and Summary messages as the tensorboard
// package defines them (compiled at build time from its own descriptors), each
// framed as a TFRecord (length, masked CRC-32C of the length, the message,
// masked CRC-32C of the message), the framing TensorBoard's reader checks.
// Built apart from LibTorch (whose library exports an older protobuf's symbols)
// into the composer-tensorboard program, which composer feeds (tensorboard.h).
#pragma once
#include <boost/crc.hpp>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace composer::tensorboard_events {

// CRC-32C (Castagnoli, Boost.CRC) of n bytes, and TFRecord's masked form of it.
inline uint32_t crc32c(const void* data, size_t n) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, n);
  return crc.checksum();
}
inline uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

class EventFile {
 public:
  // Creates `dir` and a new event file in it
  // (events.out.tfevents.<seconds>.<host>.<pid>) whose first event names the
  // format's version. Throws std::runtime_error when it cannot.
  explicit EventFile(const std::string& dir);
  // One event at `step` with a simple_value scalar per (tag, value), flushed.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  std::ofstream out_;
};

}  // namespace composer::tensorboard_events

#include "runner/observe/tensorboard_events.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>

#include "tensorboard/compat/proto/event.pb.h"

namespace composer::tensorboard_events {

namespace {

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void put_le(std::string& s, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

EventFile::EventFile(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(dir + ": cannot create the TensorBoard folder: " + ec.message());
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(wall_time())) + "." + host + "." +
          std::to_string(getpid());
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error(path_ + ": cannot write the TensorBoard event file");
  tensorboard::Event e;
  e.set_wall_time(wall_time());
  e.set_file_version("brain.Event:2");
  write_record(e.SerializeAsString());
}

void EventFile::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  tensorboard::Event e;
  e.set_wall_time(wall_time());
  e.set_step(step);
  for (const auto& [tag, v] : values) {
    auto* value = e.mutable_summary()->add_value();
    value->set_tag(tag);
    value->set_simple_value(static_cast<float>(v));
  }
  write_record(e.SerializeAsString());
}

void EventFile::write_record(const std::string& bytes) {
  std::string header;
  put_le(header, bytes.size(), 8);
  std::string record = header;
  put_le(record, masked_crc32c(header.data(), header.size()), 4);
  record += bytes;
  put_le(record, masked_crc32c(bytes.data(), bytes.size()), 4);
  out_.write(record.data(), static_cast<std::streamsize>(record.size()));
  out_.flush();
  if (!out_) throw std::runtime_error(path_ + ": cannot write the TensorBoard event file (disk full?)");
}

}  // namespace composer::tensorboard_events

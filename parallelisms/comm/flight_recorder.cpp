#include "parallelisms/comm/flight_recorder.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "parallelisms/comm/mesh.h"

namespace composer::parallel {
namespace {

thread_local std::string current_site;
thread_local bool training_thread = false;
thread_local int clock_depth = 0;
thread_local int64_t clock_total_ns = 0;

template <size_t N>
void copy_text(char (&dst)[N], const std::string& src) {
  std::memset(dst, 0, N);
  std::memcpy(dst, src.data(), std::min(src.size(), N - 1));
}

}  // namespace

int64_t monotonic_now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void mark_training_thread() { training_thread = true; }

CommClock::CommClock() {
  if (clock_depth++ == 0) start_ = monotonic_now_ns();
}
CommClock::~CommClock() {
  if (--clock_depth == 0) clock_total_ns += monotonic_now_ns() - start_;
}
int64_t CommClock::take_ns() {
  const int64_t t = clock_total_ns;
  clock_total_ns = 0;
  return t;
}

CommSite::CommSite(std::string site) : outer_(std::move(current_site)) { current_site = std::move(site); }
CommSite::~CommSite() { current_site = std::move(outer_); }

FlightRecorder::FlightRecorder(int rank, int64_t capacity, const std::string& path) : path_(path) {
  TORCH_CHECK(capacity > 0, "a flight recorder needs at least one record");
  mapped_bytes_ = sizeof(FlightHeader) + static_cast<size_t>(capacity) * sizeof(FlightRecord);
  if (!path.empty()) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0 && ::ftruncate(fd, static_cast<off_t>(mapped_bytes_)) == 0) {
      void* p = ::mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        base_ = p;
        mapped_ = true;
      }
    }
    if (fd >= 0) ::close(fd);
  }
  if (!base_) {  // in this process only (no file, or it could not be mapped)
    path_.clear();
    base_ = std::calloc(1, mapped_bytes_);
    TORCH_CHECK(base_, "cannot allocate the flight recorder");
  }
  header_ = new (base_) FlightHeader();
  header_->rank = rank;
  header_->capacity = static_cast<int32_t>(capacity);
  ring_ = reinterpret_cast<FlightRecord*>(static_cast<char*>(base_) + sizeof(FlightHeader));
  for (int64_t i = 0; i < capacity; ++i) new (&ring_[i]) FlightRecord();
}

FlightRecorder::~FlightRecorder() {
  if (mapped_) ::munmap(base_, mapped_bytes_);
  else std::free(base_);
}

FlightRecord* FlightRecorder::slot_of(uint64_t id) const {
  FlightRecord* r = &ring_[(id - 1) % static_cast<uint64_t>(header_->capacity)];
  return r->id == id ? r : nullptr;  // overwritten by a newer record: nothing to mark
}

uint64_t FlightRecorder::issue(const Group& g, const char* kind, int peer, int64_t bytes, c10::ScalarType dtype) {
  const std::string group = comm_key(g);
  std::lock_guard<std::mutex> lock(mu_);
  const bool p2p = peer >= 0;
  const int global_peer = p2p ? g.ranks.at(peer) : -1;
  const uint64_t seq = ++seqs_[p2p ? group + " " + kind + " " + std::to_string(global_peer) : group];
  const uint64_t id = header_->next_id++;
  FlightRecord& r = ring_[(id - 1) % static_cast<uint64_t>(header_->capacity)];
  r.id = 0;  // invalid while it is rewritten
  r.seq = seq;
  r.bytes = bytes;
  r.issued_ns = monotonic_now_ns();
  r.waited_ns = r.issued_ns;  // a blocking call waits from the start
  r.started_ns = 0;
  r.finished_ns = 0;
  r.step = header_->step;
  r.peer = global_peer;
  r.thread = training_thread ? 0 : 1;
  copy_text(r.kind, kind);
  copy_text(r.group, group);
  copy_text(r.dtype, std::string(c10::toString(dtype)));
  copy_text(r.site, current_site);
  std::atomic_thread_fence(std::memory_order_release);
  r.id = id;
  return id;
}

void FlightRecorder::started(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (FlightRecord* r = slot_of(id)) r->started_ns = monotonic_now_ns();
}

void FlightRecorder::waiting(uint64_t id, bool waiting) {
  std::lock_guard<std::mutex> lock(mu_);
  if (FlightRecord* r = slot_of(id)) r->waited_ns = waiting ? monotonic_now_ns() : 0;
}

void FlightRecorder::finished(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (FlightRecord* r = slot_of(id)) {
    if (!r->started_ns) r->started_ns = r->issued_ns;
    r->finished_ns = monotonic_now_ns();
  }
}

void FlightRecorder::set_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  header_->step = step;
}

int64_t FlightRecorder::step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return header_->step;
}

bool FlightRecorder::skips_reduction() {
  if (skip_step_.load(std::memory_order_relaxed) < 0) return false;  // the common case: no injection
  std::lock_guard<std::mutex> lock(mu_);
  if (skip_step_ < 0 || header_->step != skip_step_) return false;
  skip_step_ = -1;
  return true;
}

std::vector<FlightRecord> FlightRecorder::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightRecord> out;
  for (int32_t i = 0; i < header_->capacity; ++i) {
    if (ring_[i].id) out.push_back(ring_[i]);
  }
  std::sort(out.begin(), out.end(), [](const FlightRecord& a, const FlightRecord& b) { return a.id < b.id; });
  return out;
}

std::vector<FlightRecord> FlightRecorder::read_file(const std::string& path, int* rank, int64_t* step) {
  std::ifstream in(path, std::ios::binary);
  FlightHeader h;
  std::vector<FlightRecord> out;
  if (!in.read(reinterpret_cast<char*>(&h), sizeof h) || std::memcmp(h.magic, "CFLIGHT2", 8) != 0) return out;
  if (rank) *rank = h.rank;
  if (step) *step = h.step;
  for (int32_t i = 0; i < h.capacity; ++i) {
    FlightRecord r;
    if (!in.read(reinterpret_cast<char*>(&r), sizeof r)) break;
    if (r.id) out.push_back(r);
  }
  std::sort(out.begin(), out.end(), [](const FlightRecord& a, const FlightRecord& b) { return a.id < b.id; });
  return out;
}

}  // namespace composer::parallel

#include "runner/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace composer::memory {

namespace {

std::atomic<int64_t> live{0};
std::atomic<int64_t> peak{0};

void add(int64_t n) {
  const int64_t now = live.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t p = peak.load(std::memory_order_relaxed);
  while (now > p && !peak.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
  }
}

// Each allocation carries its size in a prefix of kPrefix bytes (keeping c10's
// 64-byte alignment), so that data pointer and context stay one pointer, as
// raw_allocate() requires.
constexpr size_t kPrefix = 64;
c10::Allocator* base = nullptr;

void release(void* data) {
  char* block = static_cast<char*>(data) - kPrefix;
  live.fetch_sub(*reinterpret_cast<int64_t*>(block), std::memory_order_relaxed);
  base->raw_deallocate(block);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    char* block = static_cast<char*>(base->raw_allocate(n + kPrefix));
    *reinterpret_cast<int64_t*>(block) = static_cast<int64_t>(n);
    add(static_cast<int64_t>(n));
    void* data = block + kPrefix;
    return {data, data, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

std::atomic<bool> installed{false};

}  // namespace

void install_counting_allocator() {
  if (installed.exchange(true)) return;
  base = c10::GetCPUAllocator();
  if (!base->raw_deleter()) {  // a CPU allocator whose pointers carry contexts: leave it uncounted
    installed = false;
    return;
  }
  static CountingAllocator counting_allocator;
  c10::SetCPUAllocator(&counting_allocator, /*priority=*/1);
}

bool counting() { return installed.load(); }
int64_t live_bytes() { return live.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return peak.load(std::memory_order_relaxed); }
void reset_peak() { peak.store(live.load(std::memory_order_relaxed), std::memory_order_relaxed); }

namespace {

std::atomic<int64_t> meta_live{0};
std::atomic<int64_t> meta_peak{0};

void meta_release(void* ctx) {
  auto* n = static_cast<int64_t*>(ctx);
  meta_live.fetch_sub(*n, std::memory_order_relaxed);
  delete n;
}

// Meta storage has no data; each pointer's context holds its size.
class MetaCountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const int64_t now = meta_live.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t p = meta_peak.load();
    while (now > p && !meta_peak.compare_exchange_weak(p, now)) {
    }
    return {nullptr, new int64_t(static_cast<int64_t>(n)), &meta_release, c10::Device(c10::kMeta)};
  }
  void copy_data(void*, const void*, std::size_t) const override {}
};

MetaCountingAllocator meta_counting;
c10::Allocator* meta_base = nullptr;
std::mutex meta_mu;
int meta_counts = 0;

}  // namespace

MetaCount::MetaCount() {
  std::lock_guard<std::mutex> g(meta_mu);
  if (meta_counts++ == 0) {
    meta_base = c10::GetAllocator(c10::kMeta);
    c10::SetAllocator(c10::kMeta, &meta_counting, /*priority=*/UINT8_MAX);
    meta_peak = meta_live.load();
  }
}

MetaCount::~MetaCount() {
  std::lock_guard<std::mutex> g(meta_mu);
  if (--meta_counts == 0) c10::SetAllocator(c10::kMeta, meta_base, /*priority=*/UINT8_MAX);
}

int64_t MetaCount::live() const { return meta_live.load(); }
int64_t MetaCount::peak() const { return meta_peak.load(); }
void MetaCount::reset_peak() { meta_peak = meta_live.load(); }

}  // namespace composer::memory

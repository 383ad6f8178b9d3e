#include "runner/base/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>

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
// raw_allocate() requires. The second word marks a probe's allocation
// (matmul_workspace_bytes), counted by the probe and not in the rank's count.
constexpr size_t kPrefix = 64;
c10::Allocator* base = nullptr;

struct Probe {
  int64_t live = 0, peak = 0;
};
thread_local Probe* probing = nullptr;

void release(void* data) {
  char* block = static_cast<char*>(data) - kPrefix;
  const int64_t n = reinterpret_cast<int64_t*>(block)[0];
  if (reinterpret_cast<int64_t*>(block)[1]) {
    if (probing) probing->live -= n;
  } else {
    live.fetch_sub(n, std::memory_order_relaxed);
  }
  base->raw_deallocate(block);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    char* block = static_cast<char*>(base->raw_allocate(n + kPrefix));
    reinterpret_cast<int64_t*>(block)[0] = static_cast<int64_t>(n);
    reinterpret_cast<int64_t*>(block)[1] = probing != nullptr;
    if (probing) {
      probing->live += static_cast<int64_t>(n);
      probing->peak = std::max(probing->peak, probing->live);
    } else {
      add(static_cast<int64_t>(n));
    }
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
  // The highest priority: it wraps whatever CPU allocator is in place, so it always counts.
  c10::SetCPUAllocator(&counting_allocator, /*priority=*/UINT8_MAX);
}

bool counting() { return installed.load(); }
int64_t live_bytes() { return live.load(std::memory_order_relaxed); }
int64_t peak_bytes() { return peak.load(std::memory_order_relaxed); }
void reset_peak() { peak.store(live.load(std::memory_order_relaxed), std::memory_order_relaxed); }

namespace {
thread_local int workspace_threads = 0;
}  // namespace

CpuMatmulWorkspaces::CpuMatmulWorkspaces(int threads) : previous_(workspace_threads) { workspace_threads = threads; }
CpuMatmulWorkspaces::~CpuMatmulWorkspaces() { workspace_threads = previous_; }
int CpuMatmulWorkspaces::threads() { return workspace_threads; }

namespace {

// The tensor's dims from the outermost (largest stride) to the innermost: its layout.
std::vector<int64_t> dims_outer_first(const at::Tensor& t) {
  std::vector<int64_t> order(static_cast<size_t>(t.dim()));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return t.stride(x) > t.stride(y); });
  return order;
}

// Zeros of `sizes` with their dims laid out in `order` (dims_outer_first of the operand they stand
// for), so that a transposed operand is probed transposed.
at::Tensor zeros_laid_out(const std::vector<int64_t>& order, const std::vector<int64_t>& sizes,
                          const at::TensorOptions& o) {
  std::vector<int64_t> outer_first, inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    outer_first.push_back(sizes[static_cast<size_t>(order[i])]);
    inverse[static_cast<size_t>(order[i])] = static_cast<int64_t>(i);
  }
  return at::zeros(outer_first, o).permute(inverse);
}

// The operand's sizes with its matrix dims clamped to kProbeDim and its batch dims to kProbeBatch.
std::vector<int64_t> probe_sizes(const at::Tensor& t) {
  std::vector<int64_t> s = t.sizes().vec();
  for (size_t i = 0; i < s.size(); ++i) s[i] = std::min(s[i], i + 2 < s.size() ? kProbeBatch : kProbeDim);
  return s;
}

}  // namespace

int64_t matmul_workspace_bytes(MatmulKind kind, const at::Tensor& a, const at::Tensor& b) {
  const auto dtype = a.scalar_type();
  const int threads = CpuMatmulWorkspaces::threads();
  if (!threads || !installed.load() || (dtype != at::kBFloat16 && dtype != at::kHalf)) return 0;
  const std::vector<int64_t> as = probe_sizes(a), bs = probe_sizes(b);
  const std::vector<int64_t> a_order = dims_outer_first(a), b_order = dims_outer_first(b);
  using Key = std::tuple<int, at::ScalarType, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                         std::vector<int64_t>, int>;
  static std::mutex mu;
  static std::map<Key, int64_t> cache;
  Key key{static_cast<int>(kind), dtype, as, a_order, bs, b_order, threads};
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  // Every tensor made here is the probe's, counted by it and not in the rank's count.
  Probe probe;
  const int outer_threads = at::get_num_threads();
  at::set_num_threads(threads);
  probing = &probe;
  int64_t scratch = 0;
  {
    auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    auto x = zeros_laid_out(a_order, as, options);
    auto y = zeros_laid_out(b_order, bs, options);
    const int64_t n = y.size(-1);
    auto bias = kind == MatmulKind::kAddmm ? at::zeros({n}, options)
                : kind == MatmulKind::kBaddbmm ? at::zeros({1, 1, n}, options)
                                               : at::Tensor();
    const int64_t inputs = probe.live;
    probe.peak = inputs;
    at::Tensor out;
    switch (kind) {
      case MatmulKind::kMm: out = at::mm(x, y); break;
      case MatmulKind::kAddmm: out = at::addmm(bias, x, y); break;
      case MatmulKind::kBmm: out = at::bmm(x, y); break;
      case MatmulKind::kBaddbmm: out = at::baddbmm(bias, x, y); break;
    }
    scratch = probe.peak - inputs - static_cast<int64_t>(out.nbytes());
  }
  probing = nullptr;
  at::set_num_threads(outer_threads);
  const int64_t workspace = std::max<int64_t>(0, scratch);
  std::lock_guard<std::mutex> g(mu);
  cache[key] = workspace;
  return workspace;
}

namespace {

std::atomic<int64_t> meta_live{0};
std::atomic<int64_t> meta_peak{0};
std::atomic<int64_t> meta_limit{0};    // MetaLimit's bytes; 0: none
std::atomic<int> meta_armed{0};        // MetaLimit::Armed regions open
std::atomic<bool> meta_crossed{false};

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
    const int64_t limit = meta_limit.load();
    if (limit > 0 && now > limit && meta_armed.load() > 0) {
      meta_live.fetch_sub(static_cast<int64_t>(n));
      meta_crossed = true;
      throw MetaOverLimit("the dry run passed " + std::to_string(limit) + " bytes");
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

MetaLimit::MetaLimit(int64_t bytes) {
  meta_crossed = false;
  meta_limit = bytes;
}
MetaLimit::~MetaLimit() { meta_limit = 0; }
bool MetaLimit::crossed() { return meta_crossed.load(); }
MetaLimit::Armed::Armed() { ++meta_armed; }
MetaLimit::Armed::~Armed() { --meta_armed; }

}  // namespace composer::memory

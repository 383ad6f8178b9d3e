// A CPU allocator that wraps c10's and counts the bytes of live tensor
// storage and their peak, for tests that measure memory rather than guess it.
#pragma once
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

namespace composer::testing {

class CountingAllocator : public c10::Allocator {
 public:
  // The process's CPU allocator from the first call on (never destroyed:
  // storage it counted may outlive any scope).
  static CountingAllocator& installed() {
    static auto* a = new CountingAllocator();
    return *a;
  }

  // A simple data pointer (context == data, as raw_allocate requires) whose
  // deleter finds the block's size and the inner allocator's deleter.
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = inner_->allocate(n);
    void* ptr = d.get();
    TORCH_INTERNAL_ASSERT(ptr == d.get_context(), "the wrapped CPU allocator returns non-simple data pointers");
    c10::DeleterFnPtr free = d.get_deleter();
    d.release_context();
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks_[ptr] = {n, free};
    }
    const int64_t now = live_ += static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {ptr, ptr, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, size_t count) const override { std::memcpy(dest, src, count); }

  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = live_.load(); }

 private:
  CountingAllocator() : inner_(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(this, std::numeric_limits<uint8_t>::max());
  }
  struct Block {
    size_t bytes;
    c10::DeleterFnPtr free;
  };
  static void release(void* ptr) {
    CountingAllocator& a = installed();
    Block b;
    {
      std::lock_guard<std::mutex> lock(a.mu_);
      auto it = a.blocks_.find(ptr);
      TORCH_INTERNAL_ASSERT(it != a.blocks_.end(), "freeing a block the counting allocator did not hand out");
      b = it->second;
      a.blocks_.erase(it);
    }
    a.live_ -= static_cast<int64_t>(b.bytes);
    if (b.free) b.free(ptr);
  }
  c10::Allocator* inner_;
  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

}  // namespace composer::testing

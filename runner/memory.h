// Counted tensor memory: composer installs a CPU allocator that wraps c10's
// and counts the bytes of every live tensor storage, so each rank knows its
// live and peak tensor bytes exactly (the figures the plan's memory estimate
// is checked against). Storage c10 does not allocate (memory-mapped files,
// from_blob) is not counted.
#pragma once
#include <cstdint>

namespace composer::memory {

// Installs the counting allocator as the CPU allocator (once per process;
// later calls do nothing). Tensors allocated before it are not counted.
void install_counting_allocator();
bool counting();

int64_t live_bytes();  // bytes of tensor storage alive now
int64_t peak_bytes();  // the most alive at once since the last reset_peak()
void reset_peak();     // peak := live

// The same count for meta tensors (shapes without storage): while a
// MetaCount lives, the bytes meta tensors would take are counted, so running
// a step on meta tensors measures the memory it would need.
class MetaCount {
 public:
  MetaCount();
  ~MetaCount();
  MetaCount(const MetaCount&) = delete;
  MetaCount& operator=(const MetaCount&) = delete;
  int64_t live() const;
  int64_t peak() const;
  void reset_peak();
};

}  // namespace composer::memory

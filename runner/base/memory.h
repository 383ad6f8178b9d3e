// Counted tensor memory: composer installs a CPU allocator that wraps c10's
// and counts the bytes of every live tensor storage, so each rank knows its
// live and peak tensor bytes exactly (the figures the plan's memory estimate
// is checked against). Storage c10 does not allocate (memory-mapped files,
// from_blob) is not counted.
#pragma once
#include <cstdint>
#include <stdexcept>

namespace at {
class Tensor;
}

namespace composer::memory {

// Installs the counting allocator as the CPU allocator (once per process;
// later calls do nothing). Tensors allocated before it are not counted.
void install_counting_allocator();
bool counting();

int64_t live_bytes();  // bytes of tensor storage alive now
int64_t peak_bytes();  // the most alive at once since the last reset_peak()
void reset_peak();     // peak := live

// The bytes a CPU matmul of these operands' shapes, layouts and dtype
// allocates for itself while it runs, beyond its result: LibTorch computes
// bfloat16 and float16 matmuls through oneDNN on CPUs with the instructions
// for them, and oneDNN takes its scratch space (packed blocks, float32
// accumulators; a size set by its block sizes and the intra-op threads) from
// the CPU allocator. Measured once per shape class on this machine, by running
// the matmul on zeros with the counting allocator (not counted as the rank's
// own), at the operands' sizes with the matrix dims clamped to kProbeDim and
// the batch dims to kProbeBatch: beyond its blocks, the scratch does not grow
// with the operands, and a probe stays a fraction of a second (a bfloat16
// matmul without the CPU's bfloat16 instructions runs at well under
// 1 GFLOP/s). 0 for other dtypes and uncounted processes. The meta matmul
// kernels allocate it for a moment, so a dry run counts what a real run does.
enum class MatmulKind { kMm, kAddmm, kBmm, kBaddbmm };
constexpr int64_t kProbeDim = 512;
constexpr int64_t kProbeBatch = 8;
int64_t matmul_workspace_bytes(MatmulKind kind, const at::Tensor& a, const at::Tensor& b);

// While one lives on this thread, meta matmuls stand for CPU matmuls run with
// `threads` intra-op threads, and allocate their workspace (a dry run of a
// CPU plan); otherwise they allocate their result only.
class CpuMatmulWorkspaces {
 public:
  explicit CpuMatmulWorkspaces(int threads);
  ~CpuMatmulWorkspaces();
  CpuMatmulWorkspaces(const CpuMatmulWorkspaces&) = delete;
  CpuMatmulWorkspaces& operator=(const CpuMatmulWorkspaces&) = delete;
  static int threads();  // 0: none lives on this thread
 private:
  int previous_;
};

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

// While one lives, the meta allocation that takes MetaCount's live bytes past `bytes` throws
// MetaOverLimit, but only inside an Armed region (a dry run's steps: what setting a rank up holds for a
// moment counts toward no step's peak). crossed() says whether one did, though the exception was
// caught and wrapped on its way out. A dry run that is certainly over the memory stops there.
struct MetaOverLimit : std::runtime_error {
  using std::runtime_error::runtime_error;
};
class MetaLimit {
 public:
  explicit MetaLimit(int64_t bytes);
  ~MetaLimit();
  MetaLimit(const MetaLimit&) = delete;
  MetaLimit& operator=(const MetaLimit&) = delete;
  static bool crossed();
  struct Armed {
    Armed();
    ~Armed();
    Armed(const Armed&) = delete;
    Armed& operator=(const Armed&) = delete;
  };
};

}  // namespace composer::memory

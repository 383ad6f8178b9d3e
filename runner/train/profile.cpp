#include "runner/train/profile.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <filesystem>

#include "runner/base/errors.h"

namespace composer {
namespace {

namespace prof = torch::profiler::impl;

std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}

prof::ProfilerConfig config() {
  return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
}

}  // namespace

StepProfiler::StepProfiler(const ProfileConfig& c, const std::string& out_dir, int rank, bool cuda) : cuda_(cuda) {
  if (c.steps.size() != 2) return;
  first_ = c.steps[0];
  last_ = c.steps[1];
  const std::string dir = c.dir.empty() ? out_dir + "/profile" : c.dir;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw FileError(dir, "cannot create the profile folder: " + ec.message() + "; check profile.dir");
  path_ = dir + "/kineto.rank" + std::to_string(rank) + ".json";
  // A CUDA build of Kineto asks for GPUs even when it records only the CPU,
  // and logs the failure as an error; a cpu run silences it (unless
  // KINETO_LOG_LEVEL is set).
  if (!cuda) setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  // Kineto's setup (and CUPTI's) before the timed steps.
  torch::autograd::profiler::prepareProfiler(config(), activities(cuda_));
}

StepProfiler::~StepProfiler() {  // a run stopped inside the range: no trace
  mark_.reset();
  if (on_) torch::autograd::profiler::disableProfiler();
}

void StepProfiler::begin_step(int64_t step) {
  if (step < first_ || step > last_) return;
  if (!on_) {  // the first chosen step, or the first after a resume inside the range
    torch::autograd::profiler::enableProfiler(config(), activities(cuda_));
    on_ = true;
  }
  mark_name_ = "step " + std::to_string(step);
  mark_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  mark_->before(std::string_view(mark_name_), c10::ArrayRef<const c10::IValue>{});
}

void StepProfiler::end_step(int64_t step) {
  if (step < first_ || step > last_) return;
  mark_.reset();  // ends the annotation
  if (step != last_) return;
  on_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  const std::string tmp = path_ + ".tmp";
  result->save(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path_, ec);
  if (ec) throw FileError(path_, "cannot write the profiler's trace: " + ec.message());
}

}  // namespace composer

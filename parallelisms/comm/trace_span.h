// A named span in the PyTorch profiler's trace (the profile: option) while the
// profiler records on this thread; nearly free otherwise (the name is not
// even built).
#pragma once
#include <ATen/record_function.h>

#include <string>
#include <string_view>

namespace composer::parallel {

class TraceSpan {
 public:
  template <class NameFn>
  explicit TraceSpan(NameFn&& name) : rf_(at::RecordScope::USER_SCOPE) {
    if (!rf_.isActive()) return;
    name_ = name();
    rf_.before(std::string_view(name_), c10::ArrayRef<const c10::IValue>{});
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  std::string name_;      // outlives the span (declared first, destroyed last)
  at::RecordFunction rf_;  // ends the span when destroyed
};

}  // namespace composer::parallel

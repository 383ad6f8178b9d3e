// metrics.tensorboard: TensorBoard event files, written by the
// composer-tensorboard program beside composer (tensorboard_events.h: the
// messages TensorBoard itself defines, built apart from LibTorch), which this
// writer starts and feeds one JSON line per event.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace composer {

// Whether this build writes event files (protobuf, protoc and the tensorboard
// package were found when CMake configured it).
constexpr bool tensorboard_available() { return COMPOSER_TENSORBOARD != 0; }

class TensorBoardWriter {
 public:
  // Creates `dir` and starts the writer of a new event file in it. Throws
  // FileError or UserError when it cannot.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();  // waits for the file to be complete
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event at `step` holding a scalar per (tag, value).
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);

 private:
  std::string dir_;
  std::FILE* pipe_ = nullptr;
};

}  // namespace composer

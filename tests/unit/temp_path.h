// A scratch path that belongs to the running test alone: ctest -j runs test
// processes side by side, so no two tests may share a file name.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

namespace composer::testing {

inline std::string temp_path(const std::string& file) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string test = info ? std::string(info->test_suite_name()) + "." + info->name() : "global";
  return ::testing::TempDir() + "/composer." + test + "." + std::to_string(getpid()) + "." + file;
}

}  // namespace composer::testing

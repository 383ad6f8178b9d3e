#include "runner/observe/tensorboard.h"

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "runner/base/errors.h"
#include "runner/base/python_tool.h"

namespace composer {
namespace {

// composer-tensorboard, beside this program.
std::string writer_program() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string path = (ec ? std::filesystem::path(".") : self.parent_path()).string() + "/composer-tensorboard";
  if (access(path.c_str(), X_OK) != 0) {
    throw UserError(path +
                    " is missing: the TensorBoard writer is built with composer (tools/build) when "
                    "protobuf and python's tensorboard package are installed (tools/setup)");
  }
  return path;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir) : dir_(dir) {
  if (!tensorboard_available()) {
    throw UserError(
        "this composer was built without TensorBoard event files (protobuf, protoc or python's "
        "tensorboard package was missing when CMake configured it); run tools/setup and rebuild");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw FileError(dir, "cannot create the TensorBoard folder: " + ec.message() + "; check metrics.tensorboard");
  const std::string program = writer_program();
  signal(SIGPIPE, SIG_IGN);  // a writer that died is an error at the next write, not a signal
  pipe_ = popen(("exec " + shell_quoted(program) + " " + shell_quoted(dir) + " >/dev/null").c_str(), "w");
  if (!pipe_) throw RuntimeFailure("cannot start " + program);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (pipe_) pclose(pipe_);
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [tag, v] : values) list.push_back({tag, v});
  const std::string line = nlohmann::json{{"step", step}, {"scalars", list}}.dump() + "\n";
  if (std::fputs(line.c_str(), pipe_) < 0 || std::fflush(pipe_) != 0) {
    throw RuntimeFailure("the TensorBoard writer for " + dir_ + " stopped (see its error above)");
  }
}

}  // namespace composer

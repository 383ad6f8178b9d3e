#include "runner/base/python_tool.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include "runner/base/errors.h"

namespace composer {

// The project's Python and tools/ folder as the build found them (written by runner/CMakeLists.txt).
extern const char* const kPythonDefault;
extern const char* const kToolsDir;

std::string python_program() {
  const char* env = std::getenv("COMPOSER_PYTHON");
  return env && *env ? env : kPythonDefault;
}

std::string tool_script(const std::string& name) {
  const std::string path = std::string(kToolsDir) + "/" + name;
  if (access(path.c_str(), R_OK) != 0) {
    throw UserError(path + " is missing: composer runs it from the source tree it was built from; rebuild composer "
                           "(tools/build) from a checkout that has it");
  }
  return path;
}

std::string shell_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

int run_python_tool(const std::string& script, const std::vector<std::string>& args, const std::string& log) {
  std::string cmd = "exec " + shell_quoted(python_program()) + " " + shell_quoted(tool_script(script));
  for (const auto& a : args) cmd += " " + shell_quoted(a);
  cmd += " >" + shell_quoted(log) + " 2>&1 </dev/null";
  const int status = std::system(cmd.c_str());
  if (status == -1 || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

}  // namespace composer

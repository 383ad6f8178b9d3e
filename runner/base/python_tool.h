// The project's Python and its scripts under tools/, for the work a maintained
// Python library does and C++ cannot do as well: reading PyTorch's Distributed
// Checkpoint metadata (a pickle; runner/checkpoint/dcp_import.h) and logging to
// W&B and MLflow through their own clients (runner/observe/trackers.h).
#pragma once
#include <string>
#include <vector>

namespace composer {

// $COMPOSER_PYTHON, else the Python of the .venv tools/setup made (fixed when composer was built).
std::string python_program();
// tools/<name> of the source tree composer was built from (a UserError naming the fix when it is missing).
std::string tool_script(const std::string& name);
// `s` quoted for /bin/sh.
std::string shell_quoted(const std::string& s);

// Runs the Python `script` (tools/<script>) with `args`; its output and errors
// go to `log` (a file). Returns its exit status (-1: it could not run).
int run_python_tool(const std::string& script, const std::vector<std::string>& args, const std::string& log);

}  // namespace composer

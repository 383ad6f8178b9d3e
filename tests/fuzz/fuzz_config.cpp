// libFuzzer target: the config reader. The input is a YAML document, then
// optionally lines "--set path=value" after a line "#--set" (the overrides).
// Errors the user can cause are UserErrors (exit 2); anything else that
// escapes, any crash, leak or undefined behaviour is a finding.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "runner/config/config.h"
#include "runner/base/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> sets;
  const auto cut = text.find("\n#--set\n");
  if (cut != std::string::npos) {
    std::istringstream rest(text.substr(cut + 8));
    for (std::string line; std::getline(rest, line);) sets.push_back(line);
    text.resize(cut + 1);
  }
  try {
    composer::parse_config(text, "fuzz.yaml", sets);
  } catch (const composer::UserError&) {
  }
  return 0;
}

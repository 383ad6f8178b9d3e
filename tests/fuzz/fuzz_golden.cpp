// libFuzzer target: the golden-file reader. A malformed golden must be a
// FileError (exit 2): any other escape, crash, leak or undefined behaviour is
// a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "runner/base/errors.h"
#include "runner/verify/golden.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    composer::parse_golden(std::string(reinterpret_cast<const char*>(data), size), "fuzz.json");
  } catch (const composer::UserError&) {
  }
  return 0;
}

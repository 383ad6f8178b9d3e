// libFuzzer target: the checkpoint index reader. A malformed index.json must
// be a FileError (exit 2): any other escape, crash, leak or undefined
// behaviour is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "runner/checkpoint/checkpoint_index.h"
#include "runner/base/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    composer::parse_checkpoint_index(std::string(reinterpret_cast<const char*>(data), size), "fuzz/index.json");
  } catch (const composer::UserError&) {
  }
  return 0;
}

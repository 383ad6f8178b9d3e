// libFuzzer target: the safetensors reader (model weights, data files). A
// malformed file must be a FileError (exit 2): any other escape, crash, leak
// or undefined behaviour is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "runner/base/errors.h"
#include "runner/base/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto tensors = composer::parse_safetensors(std::string(reinterpret_cast<const char*>(data), size), "fuzz.safetensors");
    for (auto& [name, t] : tensors) (void)t.sum();  // touch every byte a tensor claims
  } catch (const composer::UserError&) {
  }
  return 0;
}

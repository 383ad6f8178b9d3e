// A Hugging Face folder's config.json, read into a model's arguments through
// the model's Hugging Face adapter (models/hf_adapter.h): model.from_hf.
#pragma once
#include <string>
#include <vector>

#include "models/hf_adapter.h"
#include "models/model.h"
#include "runner/base/errors.h"

namespace composer {

// Sets `args` (their defaults, and the adapter's yaml_args() the YAML gave,
// listed in `given`) from `dir`/config.json through `spec`'s adapter. A
// folder without a readable config.json, a model_type the adapter does not
// read, or a value the model cannot compute exactly is a FileError naming the
// file, the field and the fix.
void read_hf_config(const std::string& dir, const models::ModelSpec& spec, models::ModelArgs& args,
                    const std::vector<std::string>& given);

// Runs `f`, an adapter's call, turning its HfError into a FileError (`where`)
// or, with `where` empty, a UserError.
template <class F>
auto hf_call(const std::string& where, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const models::HfError& e) {
    if (where.empty()) throw UserError(e.what());
    throw FileError(where, e.what());
  }
}

}  // namespace composer

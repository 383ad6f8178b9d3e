// A registered model's default arguments, with llama shrunk so that tests
// build every model quickly.
#pragma once
#include "models/model.h"

namespace composer::testing {

inline models::ModelArgs small_args(const models::ModelSpec& s) {
  models::ModelArgs a;
  for (const auto& arg : s.args) a.set(arg.name, arg.default_value);
  if (s.name == "llama") {
    a.set("dim", int64_t{32});
    a.set("n_layers", int64_t{2});
    a.set("n_heads", int64_t{4});
    a.set("multiple_of", int64_t{16});
    a.set("max_seq_len", int64_t{8});
  }
  return a;
}

}  // namespace composer::testing

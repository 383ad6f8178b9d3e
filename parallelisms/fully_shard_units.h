// fully_shard's units: which modules of the roots are units, and which unit
// owns each parameter (so gathers it before its forward and reduces its
// gradient), derived from the modules that compute with it on this rank.
#pragma once
#include <torch/torch.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "models/select.h"

namespace composer::parallel {

// Which unit owns each parameter: every module of every root (the roots' own
// modules aside) with the units `patterns` select among them, each
// parameter's users, and the index of its owning unit (units first, then
// the roots in order).
struct Ownership {
  models::NamedModules units;
  std::unordered_map<const c10::TensorImpl*, std::vector<nn::Module*>> users;
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
};

Ownership assign_owners(const std::vector<models::Root>& roots, const std::vector<std::string>& patterns);

}  // namespace composer::parallel

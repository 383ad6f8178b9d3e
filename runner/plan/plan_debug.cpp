#include "runner/plan/plan_debug.h"

#include <algorithm>

#include "runner/base/errors.h"

namespace composer {
namespace {

// The number of single-character edits between a and b.
size_t edits(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

void check_inject_module(const ExperimentConfig& c, nn::Module& model) {
  const std::string& want = c.debug.inject_module;
  if (want.empty()) return;
  std::vector<std::pair<size_t, std::string>> near;
  for (const auto& [name, m] : nn::named_modules(model)) {
    if (name == want) return;
    if (!name.empty()) near.emplace_back(edits(name, want), name);
  }
  std::sort(near.begin(), near.end());
  std::string hint;
  for (size_t i = 0; i < std::min<size_t>(3, near.size()); ++i) hint += (i ? ", " : "") + near[i].second;
  throw PlanError(c.debug.inject_module_ref, "'" + want + "' is no module of " + c.model.name +
                                                 (hint.empty() ? "" : "; the nearest: " + hint) +
                                                 " (a module's FQN is its parameters' names without the last part)");
}

}  // namespace composer

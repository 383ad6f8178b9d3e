#include "models/select.h"

#include <unordered_set>

namespace composer::models {

namespace {

// Does pattern[i..] match fqn[j..]? Patterns are a few segments long, so
// plain backtracking is enough.
bool glob_from(const std::string& p, size_t i, const std::string& f, size_t j) {
  while (i < p.size()) {
    if (p[i] == '*') {
      const bool any_depth = i + 1 < p.size() && p[i + 1] == '*';
      const size_t rest = i + (any_depth ? 2 : 1);
      for (size_t k = j;; ++k) {
        if (glob_from(p, rest, f, k)) return true;
        if (k == f.size() || (!any_depth && f[k] == '.')) return false;
      }
    }
    if (j == f.size() || p[i] != f[j]) return false;
    ++i;
    ++j;
  }
  return j == f.size();
}

}  // namespace

bool fqn_matches(const std::string& pattern, const std::string& fqn) { return glob_from(pattern, 0, fqn, 0); }

bool matches_any(const std::vector<std::string>& patterns, const std::string& fqn) {
  for (const auto& p : patterns) {
    if (fqn_matches(p, fqn)) return true;
  }
  return false;
}

NamedModules select_modules(const NamedModules& modules, const std::vector<std::string>& patterns) {
  NamedModules out;
  std::vector<std::string> containers;
  for (const auto& [name, m] : modules) {
    const bool child_of_container = !containers.empty() && name.rfind(containers.back() + ".", 0) == 0 &&
                                    name.find('.', containers.back().size() + 1) == std::string::npos;
    if (name.empty() || !(matches_any(patterns, name) || child_of_container)) continue;
    if (dynamic_cast<nn::ModuleList*>(m)) {
      containers.push_back(name);
      continue;
    }
    out.emplace_back(name, m);
  }
  return out;
}

NamedModules select_modules(nn::Module& root, const std::vector<std::string>& patterns) {
  return select_modules(nn::named_modules(root), patterns);
}

Root whole(nn::Module& model) { return {"", &model, nn::named_modules(model)}; }

std::vector<std::pair<std::string, torch::Tensor>> root_parameters(const std::vector<Root>& roots) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& root : roots) {
    for (const auto& [name, m] : root.modules) {
      for (const auto& item : m->named_parameters(/*recurse=*/false)) {
        if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
        out.emplace_back(name.empty() ? item.key() : name + "." + item.key(), item.value());
      }
    }
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> root_parameters(const Root& root) {
  return root_parameters(std::vector<Root>{root});
}

}  // namespace composer::models

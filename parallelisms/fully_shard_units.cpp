#include "parallelisms/fully_shard_units.h"

#include <unordered_set>

namespace composer::parallel {
namespace {

// The modules the roots compute with, each once, by model FQN, without the roots themselves.
models::NamedModules root_modules(const std::vector<models::Root>& roots) {
  models::NamedModules modules;
  std::unordered_set<const nn::Module*> seen;
  for (const auto& root : roots) {
    for (const auto& [name, m] : root.modules) {
      if (m != root.module && seen.insert(m).second) modules.emplace_back(name, m);
    }
  }
  return modules;
}

bool in_root(const models::Root& root, const nn::Module* m) {
  for (const auto& [name, r] : root.modules) {
    if (r == m) return true;
  }
  return false;
}

// A parameter belongs to the innermost unit that contains every module
// computing with it on this rank (a weight tied across two units belongs to
// their common ancestor, so it is gathered for as long as either uses it);
// else to the first root holding all its users, else the first holding one
// (a weight two of this rank's stages share: that root gathers it first).
size_t owner_of(const std::vector<nn::Module*>& users, const models::NamedModules& units,
                const std::unordered_map<const nn::Module*, std::string>& name_of,
                const std::vector<models::Root>& roots) {
  auto inside = [&](const std::string& prefix, const nn::Module* m) {
    auto it = name_of.find(m);
    return it != name_of.end() && (it->second == prefix || it->second.rfind(prefix + ".", 0) == 0);
  };
  size_t best = units.size(), depth = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const auto& prefix = units[u].first;
    bool all = true;
    for (const auto* m : users) all = all && inside(prefix, m);
    if (all && prefix.size() + 1 > depth) {
      best = u;
      depth = prefix.size() + 1;
    }
  }
  for (size_t r = 0; best == units.size() && r < roots.size(); ++r) {
    bool all = true;
    for (const auto* m : users) all = all && in_root(roots[r], m);
    if (all) best = units.size() + r;
  }
  for (size_t r = 0; best == units.size() && r < roots.size(); ++r) {
    if (in_root(roots[r], users.front())) best = units.size() + r;
  }
  return best;
}

}  // namespace

Ownership assign_owners(const std::vector<models::Root>& roots, const std::vector<std::string>& patterns) {
  Ownership o;
  const models::NamedModules modules = root_modules(roots);
  o.units = models::select_modules(modules, patterns);
  for (const auto& root : roots) {
    for (auto& item : root.module->named_parameters(/*recurse=*/false)) {
      o.users[item.value().unsafeGetTensorImpl()].push_back(root.module);
    }
  }
  std::unordered_map<const nn::Module*, std::string> name_of;
  for (auto& [name, m] : modules) {
    name_of[m] = name;
    for (auto& item : m->named_parameters(/*recurse=*/false)) o.users[item.value().unsafeGetTensorImpl()].push_back(m);
  }
  for (auto& [impl, users] : o.users) o.owner[impl] = owner_of(users, o.units, name_of, roots);
  return o;
}

}  // namespace composer::parallel

// Module selection by fully-qualified-name patterns: what a transform's
// `units`, a tensor-parallel plan's rules and per_rank name.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "models/module.h"

namespace composer::models {

using NamedModules = std::vector<std::pair<std::string, nn::Module*>>;

// '*' matches any run of characters within one dotted segment; '**' any run
// across segments too (`**` alone: every module at every depth).
bool fqn_matches(const std::string& pattern, const std::string& fqn);
bool matches_any(const std::vector<std::string>& patterns, const std::string& fqn);

// The modules `patterns` select among `modules` (named, outermost first; the
// root, named "", is never selected). A matched module without a forward of
// its own (a ModuleList) never runs, so its children stand in for it.
NamedModules select_modules(const NamedModules& modules, const std::vector<std::string>& patterns);
NamedModules select_modules(nn::Module& root, const std::vector<std::string>& patterns);

// What a transform applies to: a module the step calls (the whole model, or
// one pipeline stage of it) and the modules its forward computes with, by
// their FQNs in the model, the root itself first (named "").
struct Root {
  std::string name;              // "" for the whole model, "stage 2" for a stage
  nn::Module* module = nullptr;  // pre- and post-forward hooks of the root go here
  NamedModules modules;
};

// The whole model as one root.
Root whole(nn::Module& model);

// The parameters the root's modules hold, each tensor once (a tied weight
// keeps its first name), in the model's order.
std::vector<std::pair<std::string, torch::Tensor>> root_parameters(const Root& root);

// The same over several roots: a parameter two roots share comes once, with
// the first root's name for it.
std::vector<std::pair<std::string, torch::Tensor>> root_parameters(const std::vector<Root>& roots);

}  // namespace composer::models

#include "runner/checkpoint.h"

#include <map>
#include <set>

#include "runner/errors.h"

namespace composer {

NamedTensors snapshot_params(models::Model& model) {
  NamedTensors out;
  for (auto& [name, p] : nn::unique_named_parameters(model)) out.emplace_back(name, p.detach().clone());
  return out;
}

void load_weights(models::Model& model, const std::string& path) {
  auto tensors = read_safetensors(path);
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) params.emplace(item.key(), item.value());
  std::set<std::string> loaded;
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : tensors) {
    auto it = params.find(name);
    if (it == params.end()) {
      throw FileError(path, "unexpected tensor '" + name + "': model " + model.type() +
                                " has no parameter of that name");
    }
    if (it->second.sizes() != t.sizes()) {
      throw FileError(path, "tensor '" + name + "' has shape " + c10::str(t.sizes()) + " but the model's is " +
                                c10::str(it->second.sizes()));
    }
    if (!t.is_floating_point()) throw FileError(path, "tensor '" + name + "' is not floating point");
    it->second.copy_(t);
    loaded.insert(name);
    // A tied weight is loaded under any of its names.
    for (auto& [other, q] : params) {
      if (q.unsafeGetTensorImpl() == it->second.unsafeGetTensorImpl()) loaded.insert(other);
    }
  }
  for (auto& [name, p] : params) {
    if (!loaded.count(name)) throw FileError(path, "missing tensor '" + name + "' that the model needs");
  }
}

void save_weights(models::Model& model, const std::string& path) {
  write_safetensors(path, snapshot_params(model), {{"format", "pt"}});
}

}  // namespace composer

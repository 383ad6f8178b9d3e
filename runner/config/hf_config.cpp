#include "runner/config/hf_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "models/registry.h"

namespace composer {

void read_hf_config(const std::string& dir, const models::ModelSpec& spec, models::ModelArgs& args,
                    const std::vector<std::string>& given) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::is_directory(dir)) {
    throw FileError(dir, "not a folder; from_hf names a Hugging Face model folder (config.json and safetensors)");
  }
  std::ifstream in(path);
  if (!in) throw FileError(path, "cannot read it; a Hugging Face model folder has a config.json");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw FileError(path, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw FileError(path, "expected a JSON object");
  const std::string type = j.value("model_type", std::string());
  const auto types = spec.hf->model_types();
  if (std::find(types.begin(), types.end(), type) == types.end()) {
    const std::string shown = j.contains("model_type") ? j.at("model_type").dump() : "missing";
    const models::ModelSpec* other = models::find_hf_model(type);
    if (other) {
      throw FileError(path, "model_type " + shown + " is read into model " + other->name + ", not " + spec.name +
                                "; set model.name: " + other->name);
    }
    throw FileError(path, "model_type " + shown + ": composer reads Hugging Face models of model_type " +
                              models::listed_hf_model_types() + " only");
  }
  hf_call(path, [&] { spec.hf->read_config(j, args, given); });
}

}  // namespace composer

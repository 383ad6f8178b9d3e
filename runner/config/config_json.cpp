// The resolved config as JSON (config.resolved.json, `composer plan`): the
// walk of ExperimentConfig's field lists (runner/config/field_walk.h); the
// hash that ties goldens to what they computed, and the golden's path.
#include <sstream>

#include "runner/config/config.h"

namespace composer {

nlohmann::json to_json(const ExperimentConfig& c) { return section_json(c); }

namespace {

std::string hash_of(const ExperimentConfig& c, bool with_steps) {
  nlohmann::json j = to_json(c);
  nlohmann::json part = {{"seed", j["seed"]}, {"model", j["model"]}, {"train", j["train"]}, {"data", j["data"]}};
  // Logging, threading and what a non-finite step would do do not change what is computed.
  part["train"].erase("log_every");
  part["train"].erase("threads");
  part["train"].erase("on_nonfinite");
  part["train"].erase("max_skipped");
  if (!with_steps) part["train"].erase("steps");
  std::string s = part.dump();
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  std::ostringstream os;
  os << std::hex;
  os.width(16);
  os.fill('0');
  os << h;
  return os.str();
}

}  // namespace

std::string config_hash(const ExperimentConfig& c) { return hash_of(c, true); }

std::string resume_hash(const ExperimentConfig& c) { return hash_of(c, false); }

std::string golden_path(const ExperimentConfig& c) {
  return c.check.golden.empty() ? "tests/golden/" + c.name + ".json" : c.check.golden;
}

}  // namespace composer

#include "runner/config/config_data.h"

namespace composer {

std::optional<FieldError> sources_error(const std::set<std::string>& given, bool tokens, const std::string& where) {
  if (!given.count("sources")) return std::nullopt;
  if (!tokens) {
    return FieldError{"sources", where + ".sources blends token files; set " + where + ".source: tokens or remove it"};
  }
  if (given.count("path")) {
    return FieldError{"path", where + ".path and " + where + ".sources both name the data; keep path for one "
                                                             "token file or sources for a blend"};
  }
  return std::nullopt;
}

std::optional<FieldError> TokenSource::check(const std::set<std::string>& given) {
  if (given.count("weight") && !(weight > 0)) {
    return FieldError{"weight", "weight must be positive, got " + std::to_string(weight) +
                                    "; drop the source instead of giving it weight 0"};
  }
  return std::nullopt;
}

std::optional<FieldError> DocumentsConfig::check(const std::set<std::string>& given) {
  if (given.count("eos_id") && eos_id < 0) {
    return FieldError{"eos_id", "eos_id must be a token id (>= 0); leave it out to read each token file's "
                                "document index (<path>.docs, which tools/prepare-data writes)"};
  }
  if (!mask && !loss_on_boundary) {
    return FieldError{"loss_on_boundary",
                      "loss_on_boundary: false without mask: true (Megatron's end-of-document loss mask without "
                      "the attention reset) is not built yet; set mask: true as well, which leaves the same "
                      "targets out of the loss and also keeps attention within each document"};
  }
  return std::nullopt;
}

}  // namespace composer

#include "runner/config/config_data.h"

#include "runner/config/yaml_reader.h"

namespace composer {

std::vector<TokenSource> read_token_sources(YamlMap& m, bool tokens, const std::string& where) {
  std::vector<TokenSource> out;
  if (!m.has("sources")) return out;
  const SourceRef list_ref = m.ref("sources");
  YAML::Node list = m.node("sources");
  if (!tokens) {
    throw ConfigError(list_ref, where + ".sources blends token files; set " + where + ".source: tokens or remove it");
  }
  if (m.has("path")) {
    throw ConfigError(m.ref("path"), where + ".path and " + where + ".sources both name the data; keep path for one "
                                     "token file or sources for a blend");
  }
  if (!list.IsSequence() || list.size() == 0) {
    throw ConfigError(list_ref, "expected a non-empty list of {path, weight}, e.g. sources: [{path: a.bin, weight: "
                                "0.7}, {path: b.bin, weight: 0.3}]");
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = where + ".sources[" + std::to_string(i) + "]";
    YamlMap e(list[i], path, m.context());
    TokenSource s;
    s.ref = e.self_ref();
    e.require("path", s.path);
    e.get("weight", s.weight);
    if (e.has("weight") && !(s.weight > 0)) {
      throw ConfigError(e.ref("weight"), "weight must be positive, got " + std::to_string(s.weight) +
                                             "; drop the source instead of giving it weight 0");
    }
    e.finish();
    out.push_back(std::move(s));
  }
  return out;
}

DocumentsConfig read_documents(YamlMap& m, bool tokens) {
  DocumentsConfig d;
  if (!m.has("documents")) return d;
  d.ref = m.ref("documents");
  YamlMap e(m.node("documents"), "data.documents", m.context());
  if (!tokens) {
    throw ConfigError(d.ref, "data.documents packs the documents of token files; set data.source: tokens or "
                             "remove documents");
  }
  e.get("mask", d.mask);
  e.get("eos_id", d.eos_id);
  if (e.has("eos_id")) d.eos_id_ref = e.ref("eos_id");
  if (e.has("eos_id") && d.eos_id < 0) {
    throw ConfigError(e.ref("eos_id"), "eos_id must be a token id (>= 0); leave it out to read each token file's "
                                       "document index (<path>.docs, which tools/prepare-data writes)");
  }
  e.get("loss_on_boundary", d.loss_on_boundary);
  e.finish();
  if (!d.mask && !d.loss_on_boundary) {
    throw ConfigError(e.ref("loss_on_boundary"),
                      "loss_on_boundary: false without mask: true (Megatron's end-of-document loss mask without "
                      "the attention reset) is not built yet; set mask: true as well, which leaves the same "
                      "targets out of the loss and also keeps attention within each document");
  }
  if (!d.mask) {
    throw ConfigError(d.ref, "data.documents without mask: true changes nothing (windows run across documents, as "
                             "without it); set mask: true or remove documents");
  }
  return d;
}

}  // namespace composer

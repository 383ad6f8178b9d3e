// data.sources (token files blended by weight) and data.documents (packed
// documents): their types and how they are read, for data and eval.data.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runner/base/errors.h"

namespace composer {

class YamlMap;

// data.documents: the token files hold documents one after another, and a
// sample's window packs the documents it meets (docs/configuration.md#packed-documents).
struct DocumentsConfig {
  bool mask = false;             // a token attends only within its document; positions restart at each
  int64_t eos_id = -1;           // the id ending every document; -1: each token file's index, <path>.docs
  bool loss_on_boundary = true;  // the loss at a document's last token (whose target is the next one's first)
  SourceRef ref;                 // where documents was given
  SourceRef eos_id_ref;          // where eos_id was given
  bool active() const { return mask; }
};

// data.sources: one token file of a blend and its weight.
struct TokenSource {
  std::string path;   // a token file (data.token_dtype ids)
  double weight = 1;  // relative: a sample comes from it with probability weight / the weights' sum
  SourceRef ref;      // where the entry was given
};

// `m`'s sources key (a list of {path, weight}), empty without it; `where`
// names the section in errors ("data" or "eval.data"). Refuses sources beside
// path, and sources without source: tokens (`tokens` false).
std::vector<TokenSource> read_token_sources(YamlMap& m, bool tokens, const std::string& where);

// `m`'s documents key (data.documents); only with source: tokens.
DocumentsConfig read_documents(YamlMap& m, bool tokens);

}  // namespace composer

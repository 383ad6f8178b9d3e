// data.sources (token files blended by weight) and data.documents (packed
// documents): their sections, for data and eval.data.
#pragma once
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "parallelisms/config_fields.h"
#include "runner/base/errors.h"

namespace composer {

// data.documents: the token files hold documents one after another, and a
// sample's window packs the documents it meets (docs/configuration.md#packed-documents).
// Only with source: tokens, and only with mask: true (DataConfig::check).
struct DocumentsConfig {
  bool mask = false;             // a token attends only within its document; positions restart at each
  int64_t eos_id = -1;           // the id ending every document; -1: each token file's index, <path>.docs
  bool loss_on_boundary = true;  // the loss at a document's last token (whose target is the next one's first)
  SourceRef ref;                 // where documents was given
  SourceRef eos_id_ref;          // where eos_id was given
  bool active() const { return mask; }
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("mask", mask);
    v("eos_id", eos_id);
    v.where("eos_id", eos_id_ref);
    v("loss_on_boundary", loss_on_boundary);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// data.sources: one token file of a blend and its weight.
struct TokenSource {
  static constexpr const char* kListExample =
      "{path, weight}, e.g. sources: [{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]";
  std::string path;   // a token file (data.token_dtype ids)
  double weight = 1;  // relative: a sample comes from it with probability weight / the weights' sum
  SourceRef ref;      // where the entry was given
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("path", path, kRequired);
    v("weight", weight);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// The refusal of `where`.sources ("data" or "eval.data") beside path, or
// without source: tokens (`tokens` false); nullopt without sources.
std::optional<FieldError> sources_error(const std::set<std::string>& given, bool tokens, const std::string& where);

}  // namespace composer

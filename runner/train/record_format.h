// The records of one training step that `composer diff` compares, as they lie
// on disk: one rank<r>.json per rank (a RankRecord, its entries in the rank's
// execution order) beside one safetensors file per recorded tensor. The
// recorder (record.h) writes them and the comparison (runner/verify/diff.h)
// reads them, both through the types and conversions here, so the format is
// written down once.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "parallelisms/config_fields.h"
#include "runner/base/errors.h"

namespace composer {

// What a recorded tensor is. Activations: a module's output in its first
// forward of a microbatch, the gradient flowing back into its input. A
// parameter piece: its value before the step, its gradient after the
// synchronisation, its value after the update.
enum class RecordKind { kOutput, kInputGrad, kParamBefore, kParamGrad, kParamAfter };
inline constexpr EnumName<RecordKind> kRecordKindNames[] = {{RecordKind::kOutput, "output"},
                                                            {RecordKind::kInputGrad, "input_grad"},
                                                            {RecordKind::kParamBefore, "param_before"},
                                                            {RecordKind::kParamGrad, "param_grad"},
                                                            {RecordKind::kParamAfter, "param_after"}};
inline const auto& names_of(RecordKind) { return kRecordKindNames; }

// The kind named `name` in a record; throws RuntimeFailure for a name the table lacks.
inline RecordKind record_kind(const std::string& name) {
  for (const auto& e : kRecordKindNames) {
    if (name == e.name) return e.value;
  }
  throw RuntimeFailure("a record names an unknown tensor kind '" + name + "'");
}

inline bool is_param(RecordKind k) { return k != RecordKind::kOutput && k != RecordKind::kInputGrad; }
// A parameter's value (judged element by element), not its gradient.
inline bool is_param_value(RecordKind k) { return k == RecordKind::kParamBefore || k == RecordKind::kParamAfter; }

// A rank's place in a process group: {rank, size}.
struct GroupRank {
  int rank = 0;
  int size = 1;
};

// The box of the whole parameter that a parameter piece holds.
struct ParamBox {
  std::vector<int64_t> offset, size, global;
  std::string placement;  // the spec's text ("[16, 8] tp:S(0) dp:S(0)/P(avg)"); empty: no spec, held whole
};

// Where a recorded piece lies in the whole tensor: an activation's samples in
// the global batch, its sequence positions under context parallelism and its
// tensor-parallel rank (a dim the comparison finds smaller than the whole is
// that rank's torch.chunk piece); a parameter piece's box.
struct PiecePlace {
  int64_t first_sample = 0, samples = 0;
  std::vector<int64_t> positions;   // with cp: the positions of each sample the rank holds
  std::optional<GroupRank> cp, tp;  // unset: the plan has no such group (cp also when there is no sequence)
  std::optional<ParamBox> box;      // set for parameter pieces, and only for them
};

// One recorded tensor. Its tensor is stored under `key` in `file` (relative
// to the records' folder).
struct RecordEntry {
  std::string key;  // "<kind>/<microbatch>/<module>", unique on a rank
  RecordKind kind = RecordKind::kOutput;
  std::string module;  // the module's or the parameter's FQN
  std::string type;    // the module's class ("Linear"); empty for a parameter
  int64_t microbatch = 0;
  int64_t order = 0;  // the rank's execution order
  PiecePlace where;
  std::string file;
  int64_t calls = 1;  // an output's forward calls in its microbatch (a module called again is not compared)
};

inline std::string record_key(RecordKind kind, int64_t microbatch, const std::string& module) {
  return std::string(name_of(kind)) + "/" + std::to_string(microbatch) + "/" + module;
}

// One rank's record of one step.
struct RankRecord {
  int rank = 0;
  int64_t step = 0;
  int64_t global_batch = 0, seq_len = 0;  // seq_len 0: inputs without a sequence
  int64_t local_batch = 0;                // samples per step on this rank
  // Backward ran on the rank's loss share times this: its input gradients are divided by it.
  double grad_divisor = 1;
  std::vector<RecordEntry> entries;
};

// JSON, as nlohmann's to_json/from_json (j = entry; j.get<RankRecord>()).
// Keys that do not apply are left out: "positions" and "cp" without context
// parallelism, "tp" without tensor parallelism, "placement" for a parameter
// held whole, "calls" for all but outputs.

inline void to_json(nlohmann::json& j, const GroupRank& g) { j = {g.rank, g.size}; }
inline void from_json(const nlohmann::json& j, GroupRank& g) { g = {j.at(0).get<int>(), j.at(1).get<int>()}; }

inline void to_json(nlohmann::json& j, const PiecePlace& p) {
  j = nlohmann::json::object();
  if (p.box) {
    j["offset"] = p.box->offset;
    j["size"] = p.box->size;
    j["global"] = p.box->global;
    if (!p.box->placement.empty()) j["placement"] = p.box->placement;
    return;
  }
  j["samples"] = {p.first_sample, p.samples};
  if (p.cp) {
    j["positions"] = p.positions;
    j["cp"] = *p.cp;
  }
  if (p.tp) j["tp"] = *p.tp;
}

inline void from_json(const nlohmann::json& j, PiecePlace& p) {
  using Ints = std::vector<int64_t>;
  p = {};
  if (j.contains("offset")) {
    p.box = ParamBox{j.at("offset").get<Ints>(), j.at("size").get<Ints>(), j.at("global").get<Ints>(),
                     j.value("placement", std::string())};
    return;
  }
  p.first_sample = j.at("samples").at(0).get<int64_t>();
  p.samples = j.at("samples").at(1).get<int64_t>();
  if (j.contains("cp")) {
    p.positions = j.at("positions").get<Ints>();
    p.cp = j.at("cp").get<GroupRank>();
  }
  if (j.contains("tp")) p.tp = j.at("tp").get<GroupRank>();
}

inline void to_json(nlohmann::json& j, const RecordEntry& e) {
  j = {
      {"key", e.key},
      {"kind", name_of(e.kind)},
      {"module", e.module},
      {"type", e.type},
      {"microbatch", e.microbatch},
      {"order", e.order},
      {"where", e.where},
      {"file", e.file},
  };
  if (e.kind == RecordKind::kOutput) j["calls"] = e.calls;
}

inline void from_json(const nlohmann::json& j, RecordEntry& e) {
  e.key = j.at("key").get<std::string>();
  e.kind = record_kind(j.at("kind").get<std::string>());
  e.module = j.at("module").get<std::string>();
  e.type = j.at("type").get<std::string>();
  e.microbatch = j.at("microbatch").get<int64_t>();
  e.order = j.at("order").get<int64_t>();
  e.where = j.at("where").get<PiecePlace>();
  e.file = j.at("file").get<std::string>();
  e.calls = j.value("calls", int64_t{1});
}

inline void to_json(nlohmann::json& j, const RankRecord& r) {
  j = {{"rank", r.rank},
       {"step", r.step},
       {"global_batch", r.global_batch},
       {"seq_len", r.seq_len},
       {"local_batch", r.local_batch},
       {"grad_divisor", r.grad_divisor},
       {"entries", r.entries}};
}

inline void from_json(const nlohmann::json& j, RankRecord& r) {
  r.rank = j.at("rank").get<int>();
  r.step = j.at("step").get<int64_t>();
  r.global_batch = j.at("global_batch").get<int64_t>();
  r.seq_len = j.at("seq_len").get<int64_t>();
  r.local_batch = j.value("local_batch", int64_t{0});
  r.grad_divisor = j.at("grad_divisor").get<double>();
  r.entries = j.at("entries").get<std::vector<RecordEntry>>();
}

}  // namespace composer

// How a transform's Config lists its options once. Each Config has a YAML key
// (kKey) and one field list that the YAML reader, --set, the resolved JSON and
// the docs' key table test walk, so an option and its default are written in
// one place: the member's initialiser.
//
//   struct ReplicateConfig {
//     static constexpr const char* kKey = "replicate";
//     std::vector<std::string> mesh_dim{"dp"};
//     double bucket_mb = 25;
//     template <class V> void fields(V& v) {
//       v("mesh_dim", mesh_dim, kOneOrList);  // the dims whose ranks hold copies
//       v("bucket_mb", bucket_mb, kPositive); // gradient bucket size
//     }
//   };
//
// A field's type is bool, int64_t, double, std::string, a list of strings, an
// enum with a name table (names_of(E{})), an optional enum (unset: ""), or a
// type the config reader knows (models::TpPlan, Reshard). A Config may also
// define `std::optional<FieldError> check(const std::set<std::string>& given)`,
// called after its fields are read with the keys the user gave: it sets
// defaults that depend on other fields and refuses combinations of them.
// Members outside the field list are what the planner resolves (a model's
// tensor-parallel plan, the pipeline's microbatches).
#pragma once
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace composer {

// A name table entry for enum-valued keys: {Kind::kAdam, "adam"}.
template <class E>
struct EnumName {
  E value;
  const char* name;
};

// The name of `v` in `table`, "?" for a value the table lacks.
template <class E, size_t N>
const char* lookup(const EnumName<E> (&table)[N], E v) {
  for (const auto& e : table) {
    if (e.value == v) return e.name;
  }
  return "?";
}

// The name of an enum value whose type has a name table (names_of(E{}), found
// beside the enum).
template <class E, class = decltype(names_of(E{}))>
const char* name_of(E v) {
  return lookup(names_of(E{}), v);
}

// The training and compute dtypes a config names.
enum class DType { kFloat32, kFloat64, kBFloat16, kFloat16 };
inline constexpr EnumName<DType> kDTypeNames[] = {{DType::kFloat32, "float32"},
                                                 {DType::kFloat64, "float64"},
                                                 {DType::kBFloat16, "bfloat16"},
                                                 {DType::kFloat16, "float16"}};
inline const auto& names_of(DType) { return kDTypeNames; }
c10::ScalarType scalar_type_of(DType d);

// What a field's value must satisfy, beyond its type.
enum FieldRule : unsigned {
  kAnyValue = 0,
  kPositive = 1,     // > 0
  kNonNegative = 2,  // >= 0
  kRequired = 4,     // must be given (a list: non-empty)
  kOneOrList = 8,    // a list of strings that may be written as one string
};

// What a transform's mesh dims split of a step's activations (its Config's
// kSplits). The planner, the step, the recorder and diff read it from the
// Config, never from a list of transforms (parallelisms/transforms.h states
// what each kind must provide):
//   kBatch: each rank takes its own samples; the dims join the data-parallel
//     group, which the loader splits the batch over, the loss averages over,
//     and the recorder and diff place pieces by (first sample, samples).
//   kSequence: each rank takes part of every sequence; the step slices inputs,
//     and the recorder and diff place pieces, by the positions its runtime
//     (an nn::SequenceSplit) gives each rank.
//   kWidth: each rank holds a slice of hidden widths (heads, features); the
//     recorder records the rank, and diff reads a dim smaller than the whole
//     as that rank's torch.chunk piece.
//   kLayers: each rank runs some of the model's layers; every module's
//     activations are recorded whole where it runs.
//   kNothing: the activations are what one device computes.
// kMovesActivations: the transform sends activations between ranks within a
// step (its collectives run in the forward and backward, where a rank that
// stops holds up its peers; flight reports name them). The activations a
// module returns are still placed by kSplits.
enum class Splits { kNothing, kBatch, kSequence, kWidth, kLayers };

// A Config's refusal of its fields: the key it points at ("" = the transform) and why.
struct FieldError {
  std::string key;
  std::string message;
};

// Mesh dim entries with "a+b" (dims flattened into one, as fully_shard may shard over) split into their dims.
std::vector<std::string> flat_dims(const std::vector<std::string>& entries);

}  // namespace composer

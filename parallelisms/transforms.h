// The transforms composer knows: each is its Config (its own file: the
// options, apply() and trace()), registered here once. The config reader,
// the resolved JSON, the planner and parallelize all take them from this list.
#pragma once
#include <type_traits>
#include <variant>

#include "parallelisms/activation_checkpoint.h"
#include "parallelisms/context_parallel.h"
#include "parallelisms/expert_parallel.h"
#include "parallelisms/fully_shard.h"
#include "parallelisms/pipeline/pipeline.h"
#include "parallelisms/replicate.h"
#include "parallelisms/tensor_parallel.h"

namespace composer::parallel {

using Transform = std::variant<PipelineConfig, TensorParallelConfig, ContextParallelConfig, ExpertParallelConfig,
                               ActivationCheckpointingConfig, FullyShardConfig, ReplicateConfig>;

// What every transform's Config declares beyond its options (config_fields.h
// says what each kind of split means), checked when it joins Transform: the
// build fails here, naming what is missing, until the step, the recorder and
// diff have what they need of it.
template <class C, class = void>
struct DeclaresSplits : std::false_type {};
template <class C>
struct DeclaresSplits<C, std::void_t<decltype(C::kSplits), decltype(C::kMovesActivations)>>
    : std::bool_constant<std::is_same_v<std::decay_t<decltype(C::kSplits)>, Splits> &&
                         std::is_same_v<std::decay_t<decltype(C::kMovesActivations)>, bool>> {};
template <class C, class = void>
struct HasRuntime : std::false_type {};
template <class C>
struct HasRuntime<C, std::void_t<typename C::Runtime>> : std::true_type {};

template <class C>
constexpr bool declares_its_splits() {
  static_assert(DeclaresSplits<C>::value,
                "a transform's Config declares `static constexpr Splits kSplits` (what its mesh dims split of the "
                "activations) and `static constexpr bool kMovesActivations`: the planner's data-parallel and "
                "sequence dims, the step's input slicing and loss average, the recorder's piece places and diff "
                "read them (config_fields.h)");
  if constexpr (DeclaresSplits<C>::value) {
    if constexpr (C::kSplits == Splits::kSequence) {
      static_assert(HasRuntime<C>::value,
                    "a transform that splits the sequence names its runtime, `using Runtime = X;` with X an "
                    "nn::SequenceSplit that apply() stores in Parallel::cp: the step slices inputs by its "
                    "positions(), the attention reads it, the recorder records each rank's positions and diff "
                    "places pieces by them");
      if constexpr (HasRuntime<C>::value) {
        static_assert(std::is_base_of_v<nn::SequenceSplit, typename C::Runtime>,
                      "a sequence-splitting transform's Runtime derives nn::SequenceSplit (models/sequence.h)");
      }
    }
    if constexpr (C::kSplits == Splits::kWidth) {
      static_assert(HasRuntime<C>::value,
                    "a transform that splits hidden widths names its runtime, `using Runtime = X;` with X holding "
                    "the group (group()) that apply() stores in Parallel::tp: the recorder records each rank's "
                    "place in it, and diff reads a smaller dim as that rank's torch.chunk piece");
    }
  }
  return true;
}

template <class... C>
constexpr bool every_transform_declares(std::variant<C...>*) {
  return (declares_its_splits<C>() && ...);
}
static_assert(every_transform_declares(static_cast<Transform*>(nullptr)));

// What transform `t`'s mesh dims split of the activations, and whether it
// sends activations between ranks.
inline Splits splits_of(const Transform& t) {
  return std::visit([](const auto& c) { return std::decay_t<decltype(c)>::kSplits; }, t);
}
inline bool moves_activations(const Transform& t) {
  return std::visit([](const auto& c) { return std::decay_t<decltype(c)>::kMovesActivations; }, t);
}

// Its YAML key: "fully_shard", "pipeline", ...
inline const char* name_of(const Transform& t) {
  return std::visit([](const auto& c) { return std::decay_t<decltype(c)>::kKey; }, t);
}

// std::visit over a Transform with one lambda per alternative.
template <class... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

}  // namespace composer::parallel

// The transforms composer knows: each is its Config (its own file: the
// options, apply() and trace()), registered here once. The config reader,
// the resolved JSON, the planner and parallelize all take them from this list.
#pragma once
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

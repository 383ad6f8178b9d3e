// replicate (DDP): every data-parallel rank holds the whole model. The
// transform broadcasts rank 0's parameters over the data-parallel group and
// records that parameters are Replicate there with gradients Partial
// (averaged); the gradient synchronisation (grad_sync.h) turns that into
// bucketed all-reduces that start during backward as soon as a bucket's
// gradients are accumulated.
#pragma once
#include <torch/torch.h>

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/select.h"
#include "parallelisms/comm/collectives.h"
#include "parallelisms/config_fields.h"
#include "parallelisms/grad_sync.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/placement.h"

namespace composer::parallel {

// The `replicate` transform's options (docs/configuration.md).
struct ReplicateConfig : PerRankFields {
  static constexpr const char* kKey = "replicate";
  static constexpr Splits kSplits = Splits::kBatch;
  static constexpr bool kMovesActivations = false;  // it moves gradients only
  std::vector<std::string> mesh_dim{"dp"};
  double bucket_mb = GradSyncOptions{}.bucket_mb;

  template <class V>
  void fields(V& v) {
    v("mesh_dim", mesh_dim, kOneOrList);   // the dims whose ranks hold copies
    v("bucket_mb", bucket_mb, kPositive);  // gradient bucket size
    PerRankFields::fields(v);
  }
  std::optional<FieldError> check(const std::set<std::string>&) const {
    return check_per_rank();
  }
};

struct Applying;
struct Tracing;
// Replicates the roots over the dims: parameters broadcast, gradients averaged in buckets.
bool apply(Applying& a, const ReplicateConfig& config);
// Copies change no activation at a stage's edge.
void trace(Tracing& t, const ReplicateConfig& config);

// Broadcasts rank 0's parameters over `group` and records their placement.
void apply_replicate(const std::vector<models::Root>& roots, Group& group, const ReplicateConfig& options,
                     Placements& placements);
void apply_replicate(models::Model& model, Group& group, const ReplicateConfig& options, Placements& placements);

}  // namespace composer::parallel

// parallelize: the one entry point from a training program into the
// transforms. It applies them to a model in the order they are listed, which
// is the order the user wrote and the order rule allows
// (docs/composition.md#the-order-rule): a pipeline cuts the model into this
// rank's stages first, and every later transform applies to each stage as a
// root. Each transform binds its process groups by mesh-dim name and records
// what it does in the placements; the gradient synchronisation is then
// derived from them, in one place (grad_sync.h), once the parameters have
// their values (Parallel::derive_grad_sync).
#pragma once
#include <vector>

#include "models/model.h"
#include "parallelisms/parallel.h"
#include "parallelisms/transforms.h"

namespace composer::parallel {

// Applies `transforms` to `model` in order (see the top of this file).
Parallel parallelize(models::Model& model, const std::vector<Transform>& transforms, const ParallelizeOptions& options);

}  // namespace composer::parallel

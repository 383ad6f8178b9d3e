#include "runner/planner.h"

#include <sstream>

namespace composer {
namespace {

// Composition order: tensor parallel shards the math, activation checkpointing
// wraps the sharded blocks, data parallelism shards or replicates what remains,
// and the pipeline splits the result into stages.
int order_of(TransformKind k) {
  switch (k) {
    case TransformKind::kTensorParallel: return 0;
    case TransformKind::kActivationCheckpointing: return 1;
    case TransformKind::kFullyShard:
    case TransformKind::kReplicate: return 2;
    case TransformKind::kPipeline: return 3;
  }
  return 0;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

void check_mesh(const ExperimentConfig& c, int64_t world_size) {
  const int64_t product = c.mesh.world_size();
  if (product != world_size) {
    std::ostringstream os;
    os << "mesh.shape [" << c10::Join(", ", c.mesh.shape) << "] has " << product << " ranks but the job has "
       << world_size << "; make the product of mesh.shape equal the number of ranks";
    throw PlanError(c.mesh.ref, os.str());
  }
}

void check_transforms(const ExperimentConfig& c) {
  int last_order = -1;
  std::string last_name;
  for (const auto& t : c.parallelize) {
    for (const auto& d : t.mesh_dim) {
      bool found = false;
      for (const auto& n : c.mesh.names) found = found || n == d;
      if (!found) {
        throw PlanError(t.ref, std::string(name_of(t.kind)) + " uses mesh dim '" + d +
                                   "' but mesh.names is [" + join(c.mesh.names) +
                                   "]; name one of those in mesh_dim or add the dim to the mesh");
      }
    }
    if (order_of(t.kind) < last_order) {
      throw PlanError(t.ref, std::string(name_of(t.kind)) + " comes after " + last_name +
                                 "; transforms apply in the order tensor_parallel, activation_checkpointing, "
                                 "fully_shard or replicate, pipeline: reorder parallelize");
    }
    last_order = order_of(t.kind);
    last_name = name_of(t.kind);
  }
}

}  // namespace

Plan make_plan(const ExperimentConfig& c, int64_t world_size) {
  check_mesh(c, world_size);
  check_transforms(c);
  for (const auto& t : c.parallelize) {
    throw PlanError(t.ref, std::string("the ") + name_of(t.kind) +
                               " transform is not supported yet in this version; remove it to train on one device");
  }
  if (world_size > 1) {
    throw PlanError(c.mesh.ref, "multi-rank runs (" + std::to_string(world_size) +
                                    " ranks) are not supported yet in this version; use a mesh of one device");
  }
  Plan p;
  p.world_size = world_size;
  p.local_ranks = world_size;
  p.log_prefix = "[rank 0/" + std::to_string(world_size) + "] ";
  std::ostringstream os;
  os << "model " << c.model.name << ", " << c.train.steps << " steps of " << c.train.global_batch << " samples ("
     << c.train.microbatches << " microbatch" << (c.train.microbatches > 1 ? "es" : "") << "), dtype "
     << name_of(c.train.dtype) << ", optimizer " << name_of(c.train.optimizer.name) << " lr " << c.train.optimizer.lr;
  p.summary.push_back(os.str());
  p.summary.push_back("world size " + std::to_string(world_size) + ", no parallel transforms (single device)");
  return p;
}

}  // namespace composer

// The mesh and the order of the transforms (which dims each serves, the
// order rule): the first checks of a plan, before any transform is checked
// against the model.
#include "runner/plan/plan_mesh.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

namespace composer {
namespace {

using parallel::Overloaded;

// Composition order: the pipeline cuts the model into stages first, and
// each stage is then a root for the rest; tensor parallel shards the math,
// activation checkpointing wraps the sharded blocks, and data parallelism
// shards or replicates what remains. The transforms apply in the order the
// YAML lists them, so that is the order it must list them in.
// docs/composition.md#the-order-rule states it for users.
int order_of(const parallel::Transform& t) {
  return std::visit(Overloaded{[](const PipelineConfig&) { return 0; }, [](const TensorParallelConfig&) { return 1; },
                               [](const ContextParallelConfig&) { return 1; },
                               [](const ExpertParallelConfig&) { return 1; },
                               [](const ActivationCheckpointingConfig&) { return 2; },
                               [](const FullyShardConfig&) { return 3; }, [](const ReplicateConfig&) { return 3; }},
                    t);
}

// The order rule as a phrase, from order_of: "pipeline, tensor_parallel and
// context_parallel (either order), ...".
std::string order_rule() {
  std::map<int, std::vector<std::string>> by_place;
  for (const auto& t : default_transforms()) by_place[order_of(t)].push_back(parallel::name_of(t));
  std::string s;
  for (const auto& [place, names] : by_place) {
    if (!s.empty()) s += ", ";
    for (size_t i = 0; i < names.size(); ++i) s += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
    if (names.size() > 1) s += " (either order)";
  }
  return s;
}

// An example mesh for expert_parallel and `other` (another transform) that
// both asked for dim `d`: `d` split in two, the experts' part named ep, with
// real sizes; the ranks stay as they are unless `d`'s size is prime.
std::string mesh_with_ep_split(const MeshConfig& m, const std::string& d, const std::string& other) {
  auto taken = [&](const std::string& n) { return std::find(m.names.begin(), m.names.end(), n) != m.names.end(); };
  const std::string ep = d == "ep" || !taken("ep") ? "ep" : d + "_ep";
  const std::string data = d != "ep" ? d : !taken("dp") ? "dp" : "ep_dp";
  const int64_t n = dim_size(m, d);
  int64_t k = 2;
  while (k < n && n % k != 0) ++k;
  const bool split = k < n;  // else (n prime) a world with another data-parallel dim of 2
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  for (size_t i = 0; i < m.names.size(); ++i) {
    if (m.names[i] != d) {
      shape.push_back(m.shape[i]);
      names.push_back(m.names[i]);
      continue;
    }
    shape.push_back(split ? n / k : 2);
    names.push_back(data);
    shape.push_back(split ? k : n);
    names.push_back(ep);
  }
  int64_t world = 1;
  for (int64_t x : shape) world *= x;
  std::ostringstream os;
  os << "mesh {shape: [" << c10::Join(", ", shape) << "], names: [" << join(names) << "]}";
  if (!split) os << " on " << world << " ranks";
  os << " with expert_parallel over " << ep << " and " << other << " over " << data;
  return os.str();
}

}  // namespace

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

int64_t dim_size(const MeshConfig& m, const std::string& name) {
  for (size_t i = 0; i < m.names.size(); ++i) {
    if (m.names[i] == name) return m.shape[i];
  }
  return 0;
}

void check_mesh(const ExperimentConfig& c, int64_t world_size) {
  if (c.mesh.backend == Backend::kNccl && c.mesh.device != DeviceKind::kCuda) {
    throw PlanError(c.mesh.ref, "mesh.backend nccl moves CUDA tensors only, and mesh.device is cpu: set device: "
                                "cuda, or backend: gloo");
  }
  const int64_t product = c.mesh.world_size();
  if (product != world_size) {
    std::ostringstream os;
    os << "mesh.shape [" << c10::Join(", ", c.mesh.shape) << "] has " << product << " ranks but the job has "
       << world_size << "; make the product of mesh.shape equal the number of ranks";
    throw PlanError(c.mesh.ref, os.str());
  }
}

// Whether the transform's dims split the batch (its Config's kSplits: today
// fully_shard, replicate and expert_parallel, whose ranks route their own tokens).
bool data_parallel(const TransformConfig& t) { return parallel::splits_of(t.options) == Splits::kBatch; }

// The mesh dim the sequence-splitting transform (kSplits kSequence:
// context_parallel) splits sequences over ("" without one).
std::string context_parallel_dim(const ExperimentConfig& c) {
  for (const auto& t : c.parallelize) {
    if (parallel::splits_of(t.options) == Splits::kSequence) return t.mesh_dim().front();
  }
  return "";
}

void check_order_and_dims(const ExperimentConfig& c) {
  int last_order = -1;
  std::string last_name;
  std::set<std::string> used;
  std::string ep;  // expert_parallel's dim, once listed
  std::map<std::string, std::string> user;  // the first transform over each dim
  const std::string cp = context_parallel_dim(c);
  for (const auto& t : c.parallelize) {
    const auto* fs = std::get_if<FullyShardConfig>(&t.options);
    for (const auto& entry : t.mesh_dim_entries()) {
      if (entry.find('+') != std::string::npos && !fs) {
        throw PlanError(t.ref, std::string(t.name()) + " mesh_dim '" + entry + "': only fully_shard flattens dims "
                               "with '+' (to shard over them as one); list the dims instead");
      }
    }
    for (const auto& d : t.mesh_dim()) {
      if (dim_size(c.mesh, d) == 0) {
        throw PlanError(t.ref, std::string(t.name()) + " uses mesh dim '" + d + "' but mesh.names is [" +
                                   join(c.mesh.names) + "]; name one of those in mesh_dim or add the dim to the mesh");
      }
      // fully_shard or replicate may also span context parallelism's dim: its
      // ranks hold the same parameters and average their gradients.
      // fully_shard may also span expert_parallel's dim (torchtitan's efsdp):
      // the experts stay split over it, the rest of the model is sharded over it.
      const bool experts = std::holds_alternative<ExpertParallelConfig>(t.options);
      const bool borrows_ep = d == ep && fs;
      if (used.count(d) && (d == ep || experts) && !borrows_ep) {
        const std::string other = experts ? user[d] : t.name();
        throw PlanError(t.ref, "mesh dim '" + d + "' is expert_parallel's and " + other +
                                   "'s: only fully_shard may share the experts' ranks (it shards the rest of the "
                                   "model over them); give " +
                                   (experts ? std::string("the experts") : t.name()) + " a mesh dim of its own, e.g. " +
                                   mesh_with_ep_split(c.mesh, d, other));
      }
      if (experts) ep = d;
      user.emplace(d, t.name());
      if (!used.insert(d).second && !(d == cp && data_parallel(t)) && !borrows_ep) {
        throw PlanError(t.ref, "mesh dim '" + d + "' is already used by an earlier transform; each dim serves one" +
                                   (d == cp ? " (only fully_shard or replicate may share context_parallel's)" : ""));
      }
    }
    if (order_of(t.options) < last_order) {
      throw PlanError(t.ref, std::string(t.name()) + " comes after " + last_name +
                                 "; transforms apply in the order parallelize lists them, which must be " +
                                 order_rule() + ": reorder parallelize (docs/composition.md#the-order-rule)");
    }
    last_order = order_of(t.options);
    last_name = t.name();
  }
  for (size_t i = 0; i < c.mesh.names.size(); ++i) {
    if (c.mesh.shape[i] > 1 && !used.count(c.mesh.names[i])) {
      throw PlanError(c.mesh.ref, "mesh dim '" + c.mesh.names[i] + "' has " + std::to_string(c.mesh.shape[i]) +
                                      " ranks but no transform uses it; add a transform over it (e.g. replicate: "
                                      "{mesh_dim: " + c.mesh.names[i] + "}) or make it 1");
    }
  }
}

}  // namespace composer

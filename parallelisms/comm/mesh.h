// The device mesh: named dims over ranks laid out row-major, and one c10d
// process group per slice of each dim (plus flattened groups over several
// dims). Rank arithmetic is pure and unit-tested; groups are created eagerly,
// in one global order, so no two ranks can wait on each other in a cycle.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace composer::parallel {

// The global ranks of the group of `dims` that contains `rank`: ranks that
// share every coordinate outside `dims`, ordered row-major over `dims`.
std::vector<int> group_ranks(int rank, const std::vector<int64_t>& shape, const std::vector<size_t>& dims);

// Row-major coordinates of `rank`.
std::vector<int64_t> coords_of(int rank, const std::vector<int64_t>& shape);

// Calls and payload bytes issued on one group, per collective kind.
class CommCounter {
 public:
  struct Entry {
    int64_t calls = 0;
    int64_t bytes = 0;       // payload handed to the collective (input tensor bytes)
    int64_t ring_bytes = 0;  // bytes each rank sends under a ring algorithm
  };
  void add(const std::string& op, int64_t bytes, int64_t ring_bytes);
  Entry get(const std::string& op) const;
  Entry total() const;
  std::map<std::string, Entry> all() const;
  void reset();

 private:
  mutable std::mutex mu_;
  std::map<std::string, Entry> by_op_;
};

class CudaRuntime;
class Delays;
class FlightRecorder;

// One process group as seen from this rank.
struct Group {
  std::string name;                            // "dp", "tp", "dp_replicate+dp_shard", "world"
  std::vector<int> ranks;                      // global ranks, in group-rank order
  int rank = 0;                                // this rank's index in `ranks`
  int size = 1;
  c10::intrusive_ptr<c10d::Backend> pg;        // null when size == 1
  std::string backend = "gloo";                // what moves its bytes (set without a connection too: a dry run's)
  std::shared_ptr<CommCounter> counter;        // calls and bytes issued on this group
  std::shared_ptr<const Delays> delays;        // debug.delay: sleeps at named points (null: none)
  std::shared_ptr<FlightRecorder> recorder;    // this rank's flight recorder (null: none)
};

// The communicator's name in a log or a report: `g`'s name and its global
// ranks, "dp[0,2]".
std::string comm_key(const Group& g);

struct MeshOptions {
  std::string backend = "gloo";                // gloo or nccl
  std::string host = "127.0.0.1";              // address Gloo binds to; "" = this host's name
  std::chrono::milliseconds timeout{300000};   // every collective and rendezvous
  bool connect = true;                         // false: groups without process groups (planning only)
  CudaRuntime* cuda = nullptr;                 // nccl: makes the NCCL groups (parallelisms/comm/cuda_runtime.h)
  int device = 0;                              // nccl: this rank's GPU
  std::shared_ptr<const Delays> delays;        // given to every group (debug.delay)
  std::shared_ptr<FlightRecorder> recorder;    // given to every group (metrics.flight_recorder)
};

class DeviceMesh {
 public:
  // Creates this rank's groups for every dim, the world, and each entry of
  // `flattened` (dims to merge, e.g. {"dp_replicate", "dp_shard"}).
  DeviceMesh(std::vector<std::string> names, std::vector<int64_t> shape, int rank,
             c10::intrusive_ptr<c10d::Store> store, const MeshOptions& options,
             const std::vector<std::vector<std::string>>& flattened = {});

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<int64_t>& shape() const { return shape_; }

  // The group over `dims` (one dim, several flattened, or {} for the world).
  Group& group(const std::vector<std::string>& dims);
  Group& group(const std::string& dim) { return group(std::vector<std::string>{dim}); }
  Group& world() { return group(std::vector<std::string>{}); }

  // The group of the ranks at indices `members` of this rank's `dim` group
  // (this rank among them), created on first use; only the members take part,
  // and they must ask for their shared subgroups in the same order.
  Group& subgroup(const std::string& dim, const std::vector<int>& members);

  std::vector<Group*> all_groups();

  // The rendezvous store the groups met through (null without connections).
  c10::intrusive_ptr<c10d::Store> store() const { return store_; }

 private:
  std::string key(const std::vector<std::string>& dims) const;
  void create(const std::vector<std::string>& dims, c10::intrusive_ptr<c10d::Store> store,
              const MeshOptions& options);
  void connect(Group& g, const std::string& key);

  std::vector<std::string> names_;
  std::vector<int64_t> shape_;
  int rank_, world_;
  c10::intrusive_ptr<c10d::Store> store_;
  MeshOptions options_;
  std::map<std::string, Group> groups_;
};

}  // namespace composer::parallel

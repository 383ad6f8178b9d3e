#include "parallelisms/comm/mesh.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "parallelisms/comm/cuda_runtime.h"

namespace composer::parallel {
namespace {

// c10d's flight recorder (on by default, 2000 entries) records every
// collective a process group enqueues into one process-wide table, and
// LibTorch 2.11 inserts a group's first entry into a std::map outside its
// lock: process groups enqueueing from several threads of one process (the
// in-process rank threads of the tests) crash there now and then. composer
// never reads its dumps, and it captures a traceback per collective, so it is
// off unless TORCH_FR_BUFFER_SIZE is set. Set while the program loads, before
// any thread runs or the recorder reads it.
const bool kFlightRecorderOff = [] {
  if (!std::getenv("TORCH_FR_BUFFER_SIZE") && !std::getenv("TORCH_NCCL_TRACE_BUFFER_SIZE")) {
    setenv("TORCH_FR_BUFFER_SIZE", "0", 0);
  }
  return true;
}();

}  // namespace

std::vector<int64_t> coords_of(int rank, const std::vector<int64_t>& shape) {
  std::vector<int64_t> c(shape.size());
  int64_t r = rank;
  for (size_t i = shape.size(); i-- > 0;) {
    c[i] = r % shape[i];
    r /= shape[i];
  }
  return c;
}

std::vector<int> group_ranks(int rank, const std::vector<int64_t>& shape, const std::vector<size_t>& dims) {
  auto base = coords_of(rank, shape);
  int64_t count = 1;
  for (auto d : dims) count *= shape[d];
  std::vector<int> out;
  for (int64_t i = 0; i < count; ++i) {
    auto c = base;
    int64_t rem = i;
    for (size_t k = dims.size(); k-- > 0;) {
      c[dims[k]] = rem % shape[dims[k]];
      rem /= shape[dims[k]];
    }
    int64_t r = 0;
    for (size_t d = 0; d < shape.size(); ++d) r = r * shape[d] + c[d];
    out.push_back(static_cast<int>(r));
  }
  return out;
}

DeviceMesh::DeviceMesh(std::vector<std::string> names, std::vector<int64_t> shape, int rank,
                       c10::intrusive_ptr<c10d::Store> store, const MeshOptions& options,
                       const std::vector<std::vector<std::string>>& flattened)
    : names_(std::move(names)), shape_(std::move(shape)), rank_(rank), world_(1), store_(store), options_(options) {
  for (auto s : shape_) world_ *= static_cast<int>(s);
  create({}, store, options);
  for (const auto& n : names_) create({n}, store, options);
  for (const auto& dims : flattened) create(dims, store, options);
}

std::string DeviceMesh::key(const std::vector<std::string>& dims) const {
  if (dims.empty()) return "world";
  std::string k;
  for (const auto& d : dims) k += (k.empty() ? "" : "+") + d;
  return k;
}

void DeviceMesh::create(const std::vector<std::string>& dims, c10::intrusive_ptr<c10d::Store> store,
                        const MeshOptions& options) {
  const std::string k = key(dims);
  if (groups_.count(k)) return;
  std::vector<size_t> idx;
  if (dims.empty()) {
    for (size_t i = 0; i < names_.size(); ++i) idx.push_back(i);
  }
  for (const auto& d : dims) {
    auto it = std::find(names_.begin(), names_.end(), d);
    TORCH_INTERNAL_ASSERT(it != names_.end(), "mesh has no dim ", d, " (the planner checks this)");
    idx.push_back(static_cast<size_t>(it - names_.begin()));
  }
  Group g;
  g.name = k;
  g.ranks = idx.empty() ? std::vector<int>{rank_} : group_ranks(rank_, shape_, idx);
  g.size = static_cast<int>(g.ranks.size());
  g.rank = static_cast<int>(std::find(g.ranks.begin(), g.ranks.end(), rank_) - g.ranks.begin());
  g.counter = std::make_shared<CommCounter>();
  g.delays = options_.delays;
  g.recorder = options_.recorder;
  g.backend = options_.backend;
  connect(g, k);
  groups_.emplace(k, std::move(g));
}

void DeviceMesh::connect(Group& g, const std::string& key) {
  if (g.size < 2 || !options_.connect) return;
  // Every slice gets its own key space in the store: its name and first rank.
  auto prefix = c10::make_intrusive<c10d::PrefixStore>("mesh/" + key + "/" + std::to_string(g.ranks.front()), store_);
  if (options_.backend == "nccl") {
    TORCH_CHECK(options_.cuda, "an NCCL mesh needs the CUDA runtime (the planner loads it)");
    g.pg = options_.cuda->nccl(prefix, g.rank, g.size, options_.timeout, options_.device);
    return;
  }
  TORCH_CHECK(options_.backend == "gloo", "backend ", options_.backend, " is not available in this build");
  // Only out-of-line ProcessGroupGloo members are called here (see tools/setup
  // on where the gloo headers come from).
  auto opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
  opts->devices.push_back(options_.host.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                                : c10d::ProcessGroupGloo::createDeviceForHostname(options_.host));
  opts->threads = 2;
  g.pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefix, g.rank, g.size, opts);
}

Group& DeviceMesh::subgroup(const std::string& dim, const std::vector<int>& members) {
  Group& parent = group(dim);
  std::string k = dim + "{";
  for (size_t i = 0; i < members.size(); ++i) k += (i ? "," : "") + std::to_string(members[i]);
  k += "}";
  auto it = groups_.find(k);
  if (it != groups_.end()) return it->second;
  Group g;
  g.name = k;
  for (int m : members) g.ranks.push_back(parent.ranks.at(m));
  g.size = static_cast<int>(g.ranks.size());
  auto me = std::find(members.begin(), members.end(), parent.rank);
  TORCH_INTERNAL_ASSERT(me != members.end(), "rank ", rank_, " asked for a subgroup it is not in");
  g.rank = static_cast<int>(me - members.begin());
  g.counter = std::make_shared<CommCounter>();
  g.delays = options_.delays;
  g.recorder = options_.recorder;
  g.backend = options_.backend;
  connect(g, k);
  return groups_.emplace(k, std::move(g)).first->second;
}

Group& DeviceMesh::group(const std::vector<std::string>& dims) {
  auto it = groups_.find(key(dims));
  TORCH_INTERNAL_ASSERT(it != groups_.end(), "no process group for ", key(dims), "; create it with the mesh");
  return it->second;
}

std::vector<Group*> DeviceMesh::all_groups() {
  std::vector<Group*> out;
  for (auto& [k, g] : groups_) out.push_back(&g);
  return out;
}

void CommCounter::add(const std::string& op, int64_t bytes, int64_t ring_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& e = by_op_[op];
  ++e.calls;
  e.bytes += bytes;
  e.ring_bytes += ring_bytes;
}

CommCounter::Entry CommCounter::get(const std::string& op) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_op_.find(op);
  return it == by_op_.end() ? Entry{} : it->second;
}

CommCounter::Entry CommCounter::total() const {
  std::lock_guard<std::mutex> lock(mu_);
  Entry t;
  for (const auto& [op, e] : by_op_) {
    t.calls += e.calls;
    t.bytes += e.bytes;
    t.ring_bytes += e.ring_bytes;
  }
  return t;
}

std::map<std::string, CommCounter::Entry> CommCounter::all() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_op_;
}

void CommCounter::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  by_op_.clear();
}

std::string comm_key(const Group& g) {
  std::string s = g.name + "[";
  for (size_t i = 0; i < g.ranks.size(); ++i) s += (i ? "," : "") + std::to_string(g.ranks[i]);
  return s + "]";
}

}  // namespace composer::parallel

#include "runner/rank.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "runner/errors.h"

namespace composer {

RankContext single_rank(const ExperimentConfig& c, const Plan& plan) {
  RankContext r;
  r.log_prefix = "[rank 0/1] ";
  if (!c.parallelize.empty()) {
    r.mesh = std::make_unique<parallel::DeviceMesh>(c.mesh.names, c.mesh.shape, 0,
                                                    c10::make_intrusive<c10d::HashStore>(),
                                                    parallel::MeshOptions{}, plan.flat_groups);
  }
  return r;
}

RankContext join_job(const RankEnv& env, const ExperimentConfig& c, const Plan& plan) {
  if (env.world_size != plan.world_size) {
    throw UserError("WORLD_SIZE " + std::to_string(env.world_size) + " differs from the mesh's " +
                    std::to_string(plan.world_size) + " ranks (" + c.file + ": mesh.shape); make them equal");
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(c.mesh.timeout_s * 1000));
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(env.master_port);
  o.isServer = env.host_store;
  o.waitWorkers = false;
  o.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    if (!env.store_file.empty()) {
      store = c10::make_intrusive<c10d::FileStore>(env.store_file, env.world_size);
      store->setTimeout(timeout);
    } else {
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
    }
  } catch (const std::exception& e) {
    throw RuntimeFailure("rank " + std::to_string(env.rank) + " cannot reach the rendezvous at " + env.master_addr +
                         ":" + std::to_string(env.master_port) + ": " + c10::GetExceptionString(e).substr(0, 200));
  }
  parallel::MeshOptions mo;
  mo.timeout = timeout;
  mo.host = (env.master_addr == "127.0.0.1" || env.master_addr == "localhost") ? "127.0.0.1" : "";
  RankContext r;
  r.rank = env.rank;
  r.world_size = env.world_size;
  r.local_world_size = env.local_world_size;
  r.mesh = std::make_unique<parallel::DeviceMesh>(c.mesh.names, c.mesh.shape, env.rank, store, mo, plan.flat_groups);
  return r;
}

}  // namespace composer

#include "runner/launch/rank.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "runner/base/errors.h"
#include "runner/launch/rendezvous.h"

namespace composer {

void fail_on_purpose(const DebugConfig& d, int rank, const std::string& where) {
  std::cout.flush();
  if (d.fail_mode == FailMode::kExit) std::_Exit(7);
  if (d.fail_mode == FailMode::kSignal) raise(SIGKILL);
  throw RuntimeFailure("injected failure " + where + " (debug.fail_rank " + std::to_string(rank) + ")");
}

namespace {

// mesh.device cuda: binds this process to its GPU, cuda:`local_rank` (the planner has
// checked that the runtime loads and that the GPU exists), turns TF32 off
// (float32 matmuls stay float32, as on the CPU, so the goldens hold), and
// makes the mesh's groups use mesh.backend on that device.
void bind_device(const ExperimentConfig& c, int local_rank, RankContext& r, parallel::MeshOptions& mo) {
  mo.backend = name_of(c.mesh.backend);
  if (c.mesh.device != DeviceKind::kCuda) return;
  std::string why;
  r.cuda = parallel::cuda_runtime(why);
  if (!r.cuda) throw RuntimeFailure("mesh.device cuda: " + why);
  const int gpu = local_rank % std::max(1, r.cuda->device_count());  // ranks share GPUs over Gloo only (planner)
  r.cuda->set_device(gpu);
  r.cuda->disable_tf32();
  r.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(gpu));
  mo.cuda = r.cuda;
  mo.device = gpu;
}

}  // namespace

RankContext single_rank(const ExperimentConfig& c, const Plan& plan) {
  RankContext r;
  r.log_prefix = "[rank 0/1] ";
  if (!c.debug.delay.empty()) r.delays = std::make_shared<parallel::Delays>(c.debug.delay, 0);
  parallel::MeshOptions mo;
  bind_device(c, 0, r, mo);
  if (!c.parallelize.empty()) {
    mo.delays = r.delays;
    r.mesh = std::make_unique<parallel::DeviceMesh>(c.mesh.names, c.mesh.shape, 0,
                                                    c10::make_intrusive<c10d::HashStore>(), mo, plan.flat_groups);
  }
  return r;
}

RankContext join_job(const RankEnv& env, const ExperimentConfig& c, const Plan& plan) {
  if (env.world_size != plan.world_size) {
    throw UserError("WORLD_SIZE " + std::to_string(env.world_size) + " differs from the mesh's " +
                    std::to_string(plan.world_size) + " ranks (" + c.file + ": mesh.shape); make them equal");
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(c.mesh.timeout_s * 1000));
  c10::intrusive_ptr<c10d::Store> store;
  if (env.host_store) store = host_rendezvous(env.master_addr, env.master_port, timeout);
  try {
    if (!env.store_file.empty()) {
      store = c10::make_intrusive<c10d::FileStore>(env.store_file, env.world_size);
      store->setTimeout(timeout);
    } else if (!store) {
      c10d::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(env.master_port);
      o.isServer = false;
      o.timeout = timeout;
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
    }
  } catch (const std::exception& e) {
    throw RuntimeFailure("rank " + std::to_string(env.rank) + " cannot reach the rendezvous at " + env.master_addr +
                         ":" + std::to_string(env.master_port) + ": " + c10::GetExceptionString(e).substr(0, 200));
  }
  // A restart's ranks meet under keys of their own on a store that outlived the last attempt.
  if (env.attempt > 0 && env.store_file.empty()) {
    store = c10::make_intrusive<c10d::PrefixStore>("attempt-" + std::to_string(env.attempt), store);
  }
  parallel::MeshOptions mo;
  mo.timeout = timeout;
  mo.host = (env.master_addr == "127.0.0.1" || env.master_addr == "localhost") ? "127.0.0.1" : "";
  RankContext r;
  if (!c.debug.delay.empty()) r.delays = std::make_shared<parallel::Delays>(c.debug.delay, env.rank);
  mo.delays = r.delays;
  const bool skips = c.debug.inject == Inject::kSkipCollective && c.debug.inject_rank == env.rank;
  if (c.metrics.flight_recorder > 0 || skips) {
    const char* dir = std::getenv("COMPOSER_ERROR_DIR");  // composer's launcher reads the ring there
    r.flight = std::make_shared<parallel::FlightRecorder>(
        env.rank, std::max<int64_t>(c.metrics.flight_recorder, 64),
        dir ? std::string(dir) + "/flight-" + std::to_string(env.rank) + ".bin" : "");
    if (skips) r.flight->skip_first_reduction_of(c.debug.inject_step);
  }
  mo.recorder = r.flight;
  r.attempt = env.attempt;
  bind_device(c, env.local_rank, r, mo);
  r.rank = env.rank;
  r.world_size = env.world_size;
  r.local_world_size = env.local_world_size;
  r.mesh = std::make_unique<parallel::DeviceMesh>(c.mesh.names, c.mesh.shape, env.rank, store, mo, plan.flat_groups);
  return r;
}

}  // namespace composer

// This process's place in the job: its rank, the device mesh with its process
// groups (null on a single device), and its log prefix.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "parallelisms/comm/cuda_runtime.h"
#include "parallelisms/comm/delay.h"
#include "parallelisms/comm/flight_recorder.h"
#include "parallelisms/comm/mesh.h"
#include "runner/config/config.h"
#include "runner/launch/launcher.h"
#include "runner/launch/rendezvous.h"
#include "runner/plan/planner.h"

namespace composer {

struct RankContext {
  int rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  std::unique_ptr<parallel::DeviceMesh> mesh;  // null when world_size == 1
  std::string log_prefix;                      // "[rank r/N] " when composer logs it itself
  std::shared_ptr<const parallel::Delays> delays;  // debug.delay on this rank (null: none), shared with the mesh
  c10::Device device = c10::kCPU;              // where this rank's tensors live: the CPU, or cuda:LOCAL_RANK
  parallel::CudaRuntime* cuda = nullptr;       // mesh.device cuda: the loaded CUDA runtime
  std::shared_ptr<parallel::FlightRecorder> flight;  // this rank's flight recorder (null: none), shared with the mesh
  int attempt = 0;                             // launch.max_restarts: 0, then 1, 2, ... for each restart
  bool is_main() const { return rank == 0; }
};

// debug.fail_rank's failure, the way debug.fail_mode says (`where` names the
// point in the error it reports).
[[noreturn]] void fail_on_purpose(const DebugConfig& d, int rank, const std::string& where);

// The single-process context; with transforms it still gets a mesh (of
// size-1 groups, which issue no collectives).
RankContext single_rank(const ExperimentConfig& c, const Plan& plan);

// Joins the job described by `env`: connects to the rendezvous store and
// creates this rank's process groups for the mesh and the plan.
RankContext join_job(const RankEnv& env, const ExperimentConfig& c, const Plan& plan);

}  // namespace composer

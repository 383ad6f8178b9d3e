// metrics.wandb and metrics.mlflow: rank 0's scalars (those TensorBoard gets)
// and the resolved config go to a W&B run and an MLflow run through their own
// clients, in a sidecar process (tools/track.py) this writer starts and feeds
// one JSON line per step: {"step": N, "scalars": [[tag, value], ...]}, then
// {"end": "FINISHED"} or {"end": "FAILED"}.
//
// Training never waits on a tracker: the sidecar reads its input on a thread
// of its own, a line its full pipe cannot take is dropped (said once), and a
// sidecar that stopped is said once. A tracker that fails (no network) is the
// sidecar's warning, once; training goes on. At the end the sidecar gets up to
// 60 s to finish its runs (wandb's upload), then is stopped, with a warning.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "runner/config/config.h"

namespace composer {

class Trackers {
 public:
  // Starts tools/track.py for c's metrics.wandb and metrics.mlflow (some must be set).
  // `resumed_at`: the step a resumed run goes on from (0: fresh).
  Trackers(const ExperimentConfig& c, const std::string& out_dir, int64_t resumed_at);
  // Ends the runs (FAILED while an exception unwinds, else FINISHED) and waits for the sidecar.
  ~Trackers();
  Trackers(const Trackers&) = delete;
  Trackers& operator=(const Trackers&) = delete;

  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);

  static bool wanted(const ExperimentConfig& c) { return c.metrics.wandb || c.metrics.mlflow; }

 private:
  void send(const std::string& line);
  pid_t pid_ = -1;
  int fd_ = -1;
  bool dropped_ = false;
};

}  // namespace composer

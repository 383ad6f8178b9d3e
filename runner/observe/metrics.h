// A step's figures (StepRecord) and the main rank's record of them: one JSON
// line per step in <out>/metrics.jsonl and, with metrics.tensorboard, the same
// numbers as TensorBoard scalars. The progress line is progress.h's.
#pragma once
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace composer {

struct StepRecord {
  int64_t step = 0;
  bool skipped = false;  // the loss or gradient was not finite and train.on_nonfinite: skip left the update out
  bool stop = false;     // some rank was asked to stop (SIGTERM, SIGINT): the job stops after this step
  double loss = 0;
  bool has_eval = false;  // eval ran after this step (eval.every)
  double eval_loss = 0;   // its mean held-out loss
  double grad_norm = 0;
  double lr = 0;
  double step_ms = 0;
  double forward_ms = 0;                  // of step_ms: forward and loss (all microbatches)
  double backward_ms = 0;                 // backward, gradient communication included
  double optimizer_ms = 0;                // gradient norm, clipping and the optimizer step
  double data_wait_ms = 0;                // of step_ms: waiting for the step's samples (read ahead in the background)
  double pipeline_bubble = -1;            // idle fraction over the pipeline ranks this step; -1 without a pipeline
  double pipeline_bubble_formula = -1;    // the schedule's bubble with unit-cost actions
  std::vector<double> microbatch_losses;  // pipeline: each microbatch's loss (summed over dp ranks)
  int64_t recomputes = -1;                // activation checkpointing: unit forwards recomputed this step; -1 without it
  // Mixture of experts: rows routed to each expert this step over every rank
  // (summed over the logging rank's blocks), the largest max/mean over them
  // (-1: no experts), and the fraction dropped over capacity (-1: dropless).
  std::vector<double> expert_tokens;
  double expert_imbalance = -1;
  double expert_dropped = -1;
  double samples_per_s = 0;
  double tokens_per_s = 0;  // 0 for non-token models
  double peak_rss_mb = 0;
  double peak_alloc_mb = -1;  // the most tensor memory alive at once this step (memory.h), -1 uncounted
  // A GPU run: the device caching allocator's peak allocated and reserved
  // memory this step (-1 on the CPU).
  double device_peak_allocated_mb = -1;
  double device_peak_reserved_mb = -1;
  // Communication this step, as seen by the logging rank (multi-rank runs only).
  bool parallel = false;
  int64_t comm_calls = 0;
  int64_t comm_bytes = 0;                              // payload handed to collectives
  int64_t comm_ring_bytes = 0;                         // bytes a rank sends under the ring algorithms
  std::map<std::string, int64_t> comm_bytes_by_group;  // comm_bytes per process group (mesh dim, or dims joined)
  double tcp_tx_bytes = -1;  // bytes the logging rank's TCP sockets sent (kernel counters), -1 unknown
  // Time in collectives (inside them and waiting for them) and the rest of
  // the step, on the logging rank and on every rank (multi-rank runs only).
  double comm_wait_ms = -1;
  double compute_ms = -1;
  std::vector<double> rank_step_ms, rank_compute_ms, rank_comm_wait_ms;
  std::vector<int64_t> stragglers;  // the ranks named stragglers at this step
};

// Bytes this process's TCP sockets have sent so far (the kernel's
// tcpi_bytes_sent summed over every TCP socket it holds: the process groups'
// and the rendezvous store's), or -1 when the kernel does not count them.
double tcp_tx_bytes();

// The process's peak resident set (VmHWM) in MiB since start or the last
// reset_peak_rss(), which first returns freed heap memory to the system.
double peak_rss_mb();
void reset_peak_rss();

class TensorBoardWriter;
class Trackers;

// A step's metrics.jsonl line as TensorBoard scalars: every number by its key,
// nested ones as key/name (comm_bytes_by_group/dp) and lists as key/index.
std::vector<std::pair<std::string, double>> scalars_of(const nlohmann::json& line);

// A step's metrics.jsonl line: the figures every step has, then those only
// some runs have (eval, pipeline, memory counters, tokens, communication).
nlohmann::json metrics_line(const StepRecord& r);

class Metrics {
 public:
  // With `resumed_at` > 0 the file keeps its lines of steps up to that step (a
  // resumed run's history) and this run's lines follow them. With
  // `tensorboard` every line's numbers also go to an event file there.
  // With `trackers` (metrics.wandb, metrics.mlflow) they get them too.
  Metrics(const std::string& jsonl_path, int64_t resumed_at = 0, const std::string& tensorboard = "",
          std::unique_ptr<Trackers> trackers = nullptr);
  ~Metrics();
  void record(const StepRecord& r);

 private:
  std::ofstream jsonl_;
  std::unique_ptr<TensorBoardWriter> tb_;
  std::unique_ptr<Trackers> trackers_;
};

}  // namespace composer

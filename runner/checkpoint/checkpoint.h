// Model weights by fully-qualified name: strict loading (missing, unexpected
// and mis-shaped tensors are errors that name them) and saving as safetensors.
// And distributed checkpoints: one folder per step (step-000040/), in which
// every rank writes the pieces it owns (one copy of each replicated piece) to
// rank-RRRRR.safetensors with their global offsets, and rank 0, after every
// rank has synced its file, writes index.json (each tensor's dtype, global
// shape and chunks; the step, optimizer, data position, config hash, plan and
// the hashes of the files, their headers and every 1 MiB block of each
// tensor) through a temporary name: a folder without index.json is not a
// checkpoint. Loading is resharding: each rank reads the overlaps of its
// pieces under the current plan with the saved chunks (runner/checkpoint_reader.h).
#pragma once
#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "parallelisms/comm/mesh.h"
#include "parallelisms/placement.h"
#include "runner/checkpoint/checkpoint_index.h"
#include "runner/config/config.h"
#include "runner/base/optimizer.h"
#include "runner/base/safetensors.h"

namespace composer {

// The model's parameters (each tensor once) and weight buffers (nn::named_weight_buffers), detached, by FQN.
NamedTensors snapshot_params(models::Model& model);

// Copies every tensor of safetensors file `path` into the parameter of the
// same name (runner/checkpoint/weight_source.h checks names and shapes).
void load_weights(models::Model& model, const std::string& path);
// Refuses a checkpoint folder whose index was saved by a config with another
// seed, model, train or data section, as resuming from it would.
void check_resumable(const ExperimentConfig& c, const std::string& path);

void save_weights(models::Model& model, const std::string& path);

// Whether a run's checkpoints leave its frozen parameters out (train.freeze or train.lora): they never
// change, and every start of the run gives them again, from model.from_hf or init_from or drawn from the
// seed.
bool saves_trained_only(const ExperimentConfig& c);
// What such a checkpoint's index records of that start (null for a run that saves every parameter):
// {"from_hf" or "init_from": the path, "content_fnv1a64": start_weights_hash} or {"drawn_from_seed": seed}.
nlohmann::json frozen_base(const ExperimentConfig& c);
// Refuses (a ConfigError naming model.from_hf or init_from) a checkpoint `path` whose frozen parameters
// came from weights of other content than the config's give now: resuming or exporting it would pair its
// trained parameters with another base.
void check_frozen_base(const ExperimentConfig& c, const std::string& path);

// One parameter as this rank holds it: its FQN, its placement (null without
// transforms: the whole tensor on every rank) and its local tensor.
struct HeldParam {
  std::string name;
  torch::Tensor param;
  const parallel::ShardSpec* spec = nullptr;
  // A module buffer (BatchNorm's running statistics, a router's expert bias):
  // whole wherever it is held, without optimizer state; its placement names
  // the copy that is saved (rank 0's without one), and every holder loads it.
  bool buffer = false;
};

struct RankSnapshot;
struct FileStats;

class Checkpointer {
 public:
  // `world` is the job's world group (null on one rank); rank 0 logs each
  // save's and load's sizes and throughput with `log_prefix`. `store`: the
  // rendezvous store, through which asynchronous saves report their files;
  // `attempt`: launch.max_restarts' attempt (a restart resumes from the
  // newest complete checkpoint, whatever checkpoint.resume names).
  Checkpointer(const ExperimentConfig& c, const std::string& out_dir, int rank, parallel::Group* world,
               std::string log_prefix = "", c10::intrusive_ptr<c10d::Store> store = {}, int attempt = 0);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // The checkpoint folder to resume from per checkpoint.resume; "" to start fresh.
  std::string resume_path() const;
  // Whether step `step` saves (every interval steps, and the last step).
  bool due(int64_t step) const;
  // Writes step `step`'s checkpoint (every rank calls it). With
  // checkpoint.async it copies this rank's pieces to host memory and returns;
  // a writer thread writes them (waiting first for the save before, if it is
  // still being written), and rank 0's writes the index once every rank's
  // file is on disk.
  void save(int64_t step, const std::vector<HeldParam>& params, Optimizer& opt);
  // Waits for the save in flight, if any, and throws what failed in it.
  void finish();
  // In one process: writes step `step`'s checkpoint from `files` snapshots,
  // rank-0000k.safetensors for file(k), one in memory at a time, then its index
  // (dcp_import.h makes a checkpoint of another program's this way). Returns the step's folder.
  std::string save_files(int64_t step, int64_t optimizer_steps, int64_t files,
                  const std::function<RankSnapshot(int64_t)>& file);
  // Loads `path` into the parameters and optimizer state, reading only the
  // rows of the saved chunks that this rank's pieces overlap; returns its step.
  int64_t load(const std::string& path, const std::vector<HeldParam>& params, Optimizer& opt);

  const std::string& dir() const { return dir_; }

 private:
  struct InFlight;
  const ExperimentConfig& c_;
  std::string dir_;
  int rank_;
  parallel::Group* world_;
  std::string log_prefix_;
  c10::intrusive_ptr<c10d::Store> store_;  // async: the writer thread's connection
  int attempt_ = 0;
  std::unique_ptr<InFlight> inflight_;
  mutable std::optional<nlohmann::json> frozen_base_;  // frozen_base(c_), once the first index is written

  std::string newest_complete() const;
  void fail_if_asked(int64_t step) const;
  void write_index(int64_t step, int64_t optimizer_steps, const FileStats& reported) const;
  void save_async(int64_t step, const std::vector<HeldParam>& params, Optimizer& opt);
  void write_in_background(int64_t step, std::shared_ptr<RankSnapshot>& snap, int64_t optimizer_steps,
                           std::chrono::steady_clock::time_point start);

  void log_save(const std::string& folder, const nlohmann::json& index, const torch::Tensor& stats,
                double index_bytes) const;
  void prune(int64_t step) const;
};

}  // namespace composer

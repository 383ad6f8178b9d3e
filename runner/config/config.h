// The typed experiment config: one struct per YAML section, defaults in the
// struct, one line per field. Each section lists its keys once, in
// fields() (runner/config/field_walk.h): the YAML reader, --set, the resolved
// JSON and the docs' key table test all walk that list. Keys, fields and
// --set paths share one name.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <variant>
#include <string>
#include <vector>

#include "models/model.h"
#include "parallelisms/comm/delay.h"
#include "runner/base/errors.h"
#include "runner/config/config_data.h"
#include "runner/config/config_enums.h"
#include "runner/config/field_walk.h"
#include "runner/config/parallelize_config.h"

namespace composer {


struct ModelConfig {
  std::string name;             // registry name, e.g. transformer (required)
  models::ModelArgs args;       // the model's arguments, defaults filled in
  std::string init_from;        // safetensors file with initial weights by FQN ("" = seeded init)
  SourceRef init_from_ref;      // where init_from was given
  std::string from_hf;          // a Hugging Face folder (the model's adapter): config.json gives args, weights the init
  SourceRef from_hf_ref;        // where from_hf was given
  std::string lora_from;        // a PEFT LoRA folder whose adapters train.lora starts from ("" = drawn)
  SourceRef lora_from_ref;      // where lora_from was given
  SourceRef ref;                // where the model section is, for errors
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("name", name, kRequired);
    v("init_from", init_from);
    v.where("init_from", init_from_ref);
    v("from_hf", from_hf, kOmitDefault);
    v.where("from_hf", from_hf_ref);
    v("lora_from", lora_from, kOmitDefault);
    v.where("lora_from", lora_from_ref);
    v("args", args, kReadAbsent);  // last: read by name's registry entry, from from_hf's config.json when given
  }
};

struct MeshConfig {
  std::vector<int64_t> shape;        // ranks per dim, row-major; [] means one device
  std::vector<std::string> names;    // one unique name per dim, e.g. [dp, tp]
  DeviceKind device = DeviceKind::kCpu;  // where parameters, batches and gradients live
  Backend backend = Backend::kGloo;  // gloo, or nccl (cuda only); default gloo on cpu, nccl on cuda
  double timeout_s = 300;            // rendezvous and collective timeout; a dead peer fails the job after this
  double memory_per_rank_mb = 0;     // what a rank may use, for the fit check; 0 = host memory / local ranks
  SourceRef ref;
  int64_t world_size() const;
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("shape", shape);
    v("names", names);
    v("device", device);
    v("backend", backend);
    v("timeout_s", timeout_s, kPositive);
    v("memory_per_rank_mb", memory_per_rank_mb, kNonNegative);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// optimizer.muon (name: muon): torch.optim.Muon's arithmetic for the hidden weight matrices, each
// orthogonalised whole by Newton-Schulz iterations in ns_dtype; every other trained parameter
// (embeddings, the output head, norms, biases) takes AdamW with optimizer's lr, betas, eps and
// weight_decay.
struct MuonConfig {
  double lr = 0;              // Muon's peak lr, scheduled as optimizer.lr is; 0 = optimizer.lr
  double momentum = 0.95;     // the momentum buffer's decay
  bool nesterov = true;       // Nesterov momentum
  std::vector<double> ns_coefficients{3.4445, -4.7750, 2.0315};  // (a, b, c) of each iteration
  int64_t ns_steps = 5;       // Newton-Schulz iterations, under 100
  double eps = 1e-7;          // floor of the norm the matrix is divided by first
  // The iterations' dtype: bfloat16 (torch.optim.Muon's) or float32, whose results do not
  // swing with the last bit of a gradient (bfloat16's iterations turn one rounding flip of an
  // input element into changes of up to ~3% of the result's largest element)
  DType ns_dtype = DType::kBFloat16;
  MuonAdjustLr adjust_lr_fn = MuonAdjustLr::kOriginal;  // original or match_rms_adamw
  // Parameters AdamW trains although they are matrices (FQN patterns, models/select.h): the
  // embeddings and the output head. Muon takes every other 2-D weight, and each expert of a
  // 3-D expert stack [experts, out, in].
  std::vector<std::string> exclude{"*embed*.*", "output.*"};
  SourceRef ref;              // optimizer.muon
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("lr", lr, kNonNegative);
    v("momentum", momentum, kNonNegative);
    v("nesterov", nesterov);
    v("ns_coefficients", ns_coefficients);
    v("ns_steps", ns_steps, kPositive);
    v("eps", eps, kPositive);
    v("ns_dtype", ns_dtype);
    v("adjust_lr_fn", adjust_lr_fn);
    v("exclude", exclude);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

struct OptimizerConfig {
  OptimizerKind name = OptimizerKind::kAdam;  // sgd, adam, adamw or muon (muon: AdamW for what Muon does not take)
  double lr = 1e-3;                           // peak learning rate
  double momentum = 0;                        // sgd momentum
  double dampening = 0;                       // sgd dampening
  bool nesterov = false;                      // sgd Nesterov momentum
  double weight_decay = 0;                    // L2 (sgd, adam) or decoupled (adamw)
  std::vector<double> betas{0.9, 0.999};      // adam/adamw moment decay
  double eps = 1e-8;                          // adam/adamw denominator epsilon
  std::optional<MuonConfig> muon;             // name muon: Muon's options (their defaults when absent)
  template <class V>
  void fields(V& v) {
    v("name", name);
    v("lr", lr, kNonNegative);
    v("momentum", momentum, kNonNegative);
    v("dampening", dampening);
    v("nesterov", nesterov);
    v("weight_decay", weight_decay, kNonNegative);
    v("betas", betas);
    v("eps", eps, kPositive);
    v("muon", muon);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
  // name muon: optimizer.muon as given, or its defaults.
  MuonConfig muon_or_default() const { return muon ? *muon : MuonConfig{}; }
  // name muon: the matrices' peak lr (muon.lr, or lr when it is 0).
  double muon_lr() const { return muon && muon->lr > 0 ? muon->lr : lr; }
};

struct LrScheduleConfig {
  int64_t warmup_steps = 0;   // linear warmup from lr/warmup_steps to lr
  Decay decay = Decay::kNone; // after warmup: none, linear or cosine down to min_lr
  double min_lr = 0;          // learning rate at the end of the decay
  template <class V>
  void fields(V& v) {
    v("warmup_steps", warmup_steps, kNonNegative);
    v("decay", decay);
    v("min_lr", min_lr, kNonNegative);
  }
};

struct LossConfig {
  LossKind name = LossKind::kMse;  // sum, mean, mse, cross_entropy, soft_cross_entropy
  double scale = 1.0;              // the loss is multiplied by this
  template <class V>
  void fields(V& v) {
    v("name", name);
    v("scale", scale);
  }
};

// train.fp8: the matmuls of the Linear layers inside `modules` in float8 (models/float8.h).
// Absent (TrainConfig::fp8 unset): no float8.
struct Fp8Config {
  Fp8Recipe recipe = Fp8Recipe::kTensorwise;
  std::vector<std::string> modules{"layers.*"};  // FQN patterns (models/select.h); their Linear layers
  SourceRef ref;                                // train.fp8
  SourceRef modules_ref;                        // train.fp8.modules, or train.fp8 when defaulted
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("recipe", recipe);
    v("modules", modules);
    v.where("modules", modules_ref);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// train.lora: PEFT's LoRA adapters on the Linear layers inside the modules `targets` selects (every
// other parameter frozen). Absent (TrainConfig::lora unset): no adapters.
struct LoraConfig {
  int64_t rank = 8;        // r: A is [rank, in], B is [out, rank]
  double alpha = 16;       // the adapter's output is scaled by alpha / rank
  double dropout = 0;      // on the adapter's input, while training
  std::vector<std::string> targets;  // FQN patterns (models/select.h); required
  SourceRef ref;           // train.lora
  SourceRef targets_ref;   // train.lora.targets
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("rank", rank, kPositive);
    v("alpha", alpha, kPositive);
    v("dropout", dropout, kNonNegative);
    v("targets", targets, kRequired);
    v.where("targets", targets_ref);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

struct TrainConfig {
  int64_t steps = 10;              // optimizer steps
  int64_t global_batch = 8;        // samples per step over all data-parallel ranks
  int64_t microbatches = 1;        // gradient accumulation: microbatches per step
  DType dtype = DType::kFloat32;   // parameter and compute dtype
  OptimizerConfig optimizer;
  LrScheduleConfig lr_schedule;
  LossConfig loss;
  double grad_clip = 0;            // clip gradients to this global L2 norm; 0 = off
  int64_t log_every = 1;           // a log line every N steps (the last step always logs)
  int64_t threads = 0;             // intra-op threads per rank; 0 = cores / local ranks
  // A step whose loss or gradient norm is not finite: stop the job (exit 3,
  // naming the step, the rank and the parameter), or skip its update.
  OnNonFinite on_nonfinite = OnNonFinite::kStop;
  int64_t max_skipped = 5;         // skip: stop after this many skipped steps in a row
  std::optional<Fp8Config> fp8;    // given: the Linear layers it selects compute in float8
  // Parameters that do not train: each pattern names parameters or the
  // modules that hold them ('*' within a dotted segment, '**' across); they
  // get no gradient, no gradient reduction and no optimizer state.
  std::vector<std::string> freeze;
  SourceRef freeze_ref;            // where freeze was given
  std::optional<LoraConfig> lora;  // given: LoRA adapters train, the rest is frozen
  template <class V>
  void fields(V& v) {
    v("steps", steps, kPositive);
    v("global_batch", global_batch, kPositive);
    v("microbatches", microbatches, kPositive);
    v("dtype", dtype);
    v("optimizer", optimizer);
    v("lr_schedule", lr_schedule);
    v("loss", loss);
    v("grad_clip", grad_clip, kNonNegative);
    v("log_every", log_every, kPositive);
    v("threads", threads, kNonNegative);
    v("on_nonfinite", on_nonfinite);
    v("max_skipped", max_skipped, kPositive);
    v("fp8", fp8);
    v("freeze", freeze, kOmitDefault);
    v.where("freeze", freeze_ref);
    v("lora", lora);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

struct DataConfig {
  DataSource source = DataSource::kSynthetic;  // synthetic, file (safetensors) or tokens (flat token ids)
  InputKind inputs = InputKind::kAuto;         // auto: tokens for token models, else normal
  TargetKind targets = TargetKind::kAuto;      // auto: chosen by the loss
  int64_t seq_len = 0;                         // tokens per sample; 0 = the model's max_seq_len
  std::string path;                            // file: safetensors with inputs and targets; tokens: token ids
  // tokens: the file's little-endian id width (uint16 when not given); unset for other sources
  std::optional<TokenDType> token_dtype;
  SourceRef path_ref;                          // where path was given
  std::vector<TokenSource> sources;            // tokens: several files blended by weight, instead of path
  DocumentsConfig documents;                   // tokens: packed documents
  // tokens: each token file's <path>.mask (one byte per token, 1: trained as
  // a target) drops the others' loss (tools/prepare-data --chat writes it)
  bool loss_mask = false;
  template <class V>
  void fields(V& v) {
    v("source", source);
    v("inputs", inputs);
    v("targets", targets);
    v("seq_len", seq_len, kNonNegative);
    v("path", path);
    v.where("path", path_ref);
    v("token_dtype", token_dtype, kOmitDefault);
    v("sources", sources, kOmitDefault);
    v("documents", documents, kOmitDefault);
    v("loss_mask", loss_mask, kOmitDefault);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// eval.data: the held-out data; inputs, targets and seq_len are the training data's.
struct EvalDataConfig {
  DataSource source = DataSource::kSynthetic;
  std::string path;
  std::optional<TokenDType> token_dtype;  // tokens: the training data's when not given
  SourceRef path_ref;
  std::vector<TokenSource> sources;
  template <class V>
  void fields(V& v) {
    v("source", source);
    v("path", path);
    v.where("path", path_ref);
    v("token_dtype", token_dtype, kOmitDefault);
    v("sources", sources, kOmitDefault);
    v.refused("inputs", "eval.data.inputs is the training data's (data.inputs): the model's loss is computed on "
                        "them; remove it");
    v.refused("targets", "eval.data.targets is the training data's (data.targets): the model's loss is computed on "
                         "them; remove it");
    v.refused("seq_len", "eval's tokens per sample is eval.seq_len, beside eval.every; move it there");
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

struct CheckConfig {
  std::string golden;        // golden file; "" = tests/golden/<name>.json
  SourceRef golden_ref;      // where golden was given (or name, which names the default)
  double loss_rtol = 1e-5;   // per-step loss and grad-norm relative tolerance
  double loss_atol = 1e-6;   // per-step loss and grad-norm absolute tolerance
  double param_rtol = 1e-4;  // final parameter relative tolerance
  double param_atol = 1e-5;  // final parameter absolute tolerance
  template <class V>
  void fields(V& v) {
    v("golden", golden);
    v.where("golden", golden_ref);
    v("loss_rtol", loss_rtol, kNonNegative);
    v("loss_atol", loss_atol, kNonNegative);
    v("param_rtol", param_rtol, kNonNegative);
    v("param_atol", param_atol, kNonNegative);
  }
};

// Fault injection (FailMode, FailAt, Inject: runner/config/config_enums.h).
struct DebugConfig {
  int64_t fail_rank = -1;  // the rank that fails; -1 = none
  int64_t fail_step = 1;   // the step at which it fails
  int64_t fail_attempts = 1;  // it fails on this many attempts (launch.max_restarts), then runs through
  FailMode fail_mode = FailMode::kError;
  FailAt fail_at = FailAt::kStep;  // where in step fail_step it fails
  Inject inject = Inject::kNone;  // a deliberate training error; the run is wrong on purpose
  int64_t inject_step = 1;        // nan_grad: the first step it poisons; skip_collective: the step (1-based)
  int64_t inject_rank = 0;        // nan_grad, skip_collective, module_*: the rank it happens on
  std::string inject_module;      // module_output, module_grad: the module's FQN ("layers.0.attention.wo")
  SourceRef inject_module_ref;
  std::vector<parallel::Delay> delay;  // sleeps at named points on chosen ranks; results must not change
  template <class V>
  void fields(V& v) {
    v("fail_rank", fail_rank);
    v("fail_step", fail_step, kPositive);
    v("fail_attempts", fail_attempts, kPositive);
    v("fail_mode", fail_mode);
    v("fail_at", fail_at);
    v("inject", inject);
    v("inject_step", inject_step, kPositive);
    v("inject_rank", inject_rank);
    v("inject_module", inject_module);
    v.where("inject_module", inject_module_ref);
    v("delay", delay);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// Distributed checkpoints (runner/checkpoint.h).
struct CheckpointConfig {
  bool enabled = true;        // false: composer run neither saves nor resumes (as check and golden)
  std::string dir;            // "" = the run's output folder + /checkpoints
  SourceRef dir_ref;          // where dir was given
  int64_t interval = 0;       // save every N steps; 0 = only at the end of training
  int64_t keep_latest_k = 2;  // complete checkpoints kept (>= 2); older ones are deleted
  std::string resume = "auto";  // auto (newest complete checkpoint in dir, else fresh), never, or a path
  // A PyTorch Distributed Checkpoint folder (torchtitan's step-N) to start from when dir holds no
  // complete checkpoint of composer's: read by tools/dcp_import.py into dir's step-N (runner/checkpoint/dcp_import.h)
  std::string resume_from_dcp;
  SourceRef resume_from_dcp_ref;
  // async: each rank copies its pieces to host memory at the step's end and a
  // background thread writes them while training goes on (one save in flight)
  bool async_save = false;
  SourceRef ref;              // the section, for errors
  SourceRef resume_ref;       // where resume was given
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("enabled", enabled);
    v("dir", dir);
    v.where("dir", dir_ref);
    v("interval", interval, kNonNegative);
    v("keep_latest_k", keep_latest_k);
    v("resume", resume);
    v.where("resume", resume_ref);
    v("resume_from_dcp", resume_from_dcp);
    v.where("resume_from_dcp", resume_from_dcp_ref);
    v("async", async_save);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// A held-out loss during training (docs/configuration.md#eval): after every
// `every`-th step and the last, the mean loss of `batches` global batches of
// held-out data, computed without gradients under the run's plan. It does not
// change training: a run with eval trains what the same run without it trains.
struct EvalConfig {
  int64_t every = 0;    // evaluate after every N-th step and the last; 0 = no eval
  int64_t batches = 1;  // global batches (train.global_batch samples each) per evaluation
  // The held-out data (source, path, token_dtype); inputs, targets and
  // seq_len are the training data's. Without it: the training data's source.
  // Eval draws synthetic samples and token windows under its own seed (the
  // run's seed xor a constant), so they are not training's.
  std::optional<EvalDataConfig> data;
  // Eval's own batch geometry (0: the training's): samples per eval batch and
  // tokens per sample. The planner checks them as it checks training's; a
  // pipeline's stage shapes are fixed by training's, so it refuses both.
  int64_t global_batch = 0;
  int64_t seq_len = 0;
  SourceRef ref, global_batch_ref, seq_len_ref;
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("every", every, kNonNegative);
    v("batches", batches, kPositive);
    v("global_batch", global_batch, kPositive | kOmitDefault);
    v.where("global_batch", global_batch_ref);
    v("seq_len", seq_len, kPositive | kOmitDefault);
    v.where("seq_len", seq_len_ref);
    v("data", data);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// What a run records beyond metrics.jsonl.
// metrics.wandb: rank 0's scalars and the resolved config to a Weights & Biases run, through the
// wandb client in tools/track.py (runner/observe/trackers.h).
struct WandbConfig {
  std::string project = "composer";
  std::string entity;       // "" = the account's default
  std::string name;         // the run's name; "" = the config's name
  std::string mode = "online";  // online, offline (a run folder under the output folder; `wandb sync` uploads it) or disabled
  SourceRef ref;
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("project", project);
    v("entity", entity);
    v("name", name);
    v("mode", mode);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// metrics.mlflow: the same to an MLflow run, through MLflow's client in tools/track.py.
struct MlflowConfig {
  std::string tracking_uri;  // "" = file://<output folder>/mlruns (a file store)
  std::string experiment;    // "" = the config's name
  SourceRef ref;
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("tracking_uri", tracking_uri);
    v("experiment", experiment);
  }
  std::optional<FieldError> check(const std::set<std::string>&) { return std::nullopt; }
};

struct MetricsConfig {
  std::string tensorboard;  // a folder for TensorBoard event files; "" = none
  SourceRef tensorboard_ref;
  std::optional<WandbConfig> wandb;
  std::optional<MlflowConfig> mlflow;
  // A rank whose compute time per step (its step time less its time in
  // collectives) is above straggler_factor x the ranks' median (and 10 ms
  // above it) for straggler_steps steps in a row is named in the log.
  double straggler_factor = 1.5;
  int64_t straggler_steps = 3;
  int64_t flight_recorder = 2048;  // collectives and p2p operations each rank keeps for a hang report; 0 = off
  template <class V>
  void fields(V& v) {
    v("tensorboard", tensorboard);
    v.where("tensorboard", tensorboard_ref);
    v("wandb", wandb);
    v("mlflow", mlflow);
    v("straggler_factor", straggler_factor);
    v("straggler_steps", straggler_steps, kPositive);
    v("flight_recorder", flight_recorder, kNonNegative);
  }
  std::optional<FieldError> check(const std::set<std::string>& given);
};

// How composer's own launcher runs the job (docs/launching.md#restarts).
struct LaunchConfig {
  // A job whose rank fails (crashes, is killed or freezes) is stopped and
  // started again from its newest complete checkpoint, up to this many times.
  int64_t max_restarts = 0;
  double restart_wait_s = 5;  // seconds between stopping a failed attempt and the next
  SourceRef ref;
  template <class V>
  void fields(V& v) {
    v.where("", ref);
    v("max_restarts", max_restarts, kNonNegative);
    v("restart_wait_s", restart_wait_s, kNonNegative);
  }
};

// The PyTorch profiler (Kineto) over a range of steps: each rank writes a
// Chrome trace of its operators and, on cuda, of its kernels and copies on
// every stream (docs/configuration.md#profile).
struct ProfileConfig {
  std::vector<int64_t> steps;  // [first, last], 1-based and inclusive; empty = off
  std::string dir;             // "" = the run's output folder + /profile
  SourceRef dir_ref;
  template <class V>
  void fields(V& v) {
    v("steps", steps);
    v("dir", dir);
    v.where("dir", dir_ref);
  }
};

struct ExperimentConfig {
  std::string file;       // the YAML file it came from
  std::string name;       // experiment name (required): output and golden file names
  uint64_t seed = 0;      // model init and synthetic data
  ModelConfig model;
  MeshConfig mesh;
  std::vector<TransformConfig> parallelize;  // applied in this order
  TrainConfig train;
  DataConfig data;
  CheckConfig check;
  CheckpointConfig checkpoint;
  EvalConfig eval;
  MetricsConfig metrics;
  ProfileConfig profile;
  LaunchConfig launch;
  DebugConfig debug;
  // Its sections in the order they are read (model.args after model.name);
  // the rules across sections are config.cpp's, checked after them all.
  template <class V>
  void fields(V& v) {
    v("name", name, kRequired);
    v("seed", seed);
    v("model", model, kRequired);
    v("mesh", mesh);
    v("parallelize", parallelize);
    v("train", train);
    v("data", data);
    v("check", check);
    v("checkpoint", checkpoint);
    v("eval", eval);
    v("metrics", metrics);
    v("profile", profile);
    v("launch", launch);
    v("debug", debug);
  }
};

// Reads and validates a config file; `overrides` are "a.b.c=value" strings.
// Throws ConfigError (or FileError) naming the file, line, column and path.
ExperimentConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The same from YAML text (tests); `file` names it in errors.
ExperimentConfig parse_config(const std::string& yaml_text, const std::string& file,
                              const std::vector<std::string>& overrides = {});

// `c` with its data section replaced by eval's held-out data (and the seed
// eval draws samples under): what the eval data set is made from.
ExperimentConfig eval_data_config(const ExperimentConfig& c);

// The resolved config as JSON (every default filled in).
nlohmann::json to_json(const ExperimentConfig& c);

// A hash of the parallelism-independent sections (seed, model, train, data):
// a golden file is valid for every parallel plan with the same hash.
std::string config_hash(const ExperimentConfig& c);
// The same without train.steps: a checkpoint saved under another step count
// (and nothing else changed) resumes, training on to this config's steps.
std::string resume_hash(const ExperimentConfig& c);

// The default golden path: check.golden, else tests/golden/<name>.json.
std::string golden_path(const ExperimentConfig& c);

}  // namespace composer

#include "runner/config/config.h"

#include <yaml-cpp/depthguard.h>

#include <fstream>
#include <functional>
#include <sstream>

#include "models/registry.h"
#include "runner/config/config_delay.h"
#include "runner/config/config_document.h"
#include "runner/config/hf_config.h"
#include "runner/config/yaml_reader.h"

namespace composer {
namespace {

const EnumName<Backend> kBackends[] = {{Backend::kGloo, "gloo"}, {Backend::kNccl, "nccl"}};
const EnumName<DeviceKind> kDevices[] = {{DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
const EnumName<OptimizerKind> kOptimizers[] = {
    {OptimizerKind::kSgd, "sgd"}, {OptimizerKind::kAdam, "adam"}, {OptimizerKind::kAdamW, "adamw"}};
const EnumName<Decay> kDecays[] = {{Decay::kNone, "none"}, {Decay::kLinear, "linear"}, {Decay::kCosine, "cosine"}};
const EnumName<LossKind> kLosses[] = {{LossKind::kSum, "sum"},
                                      {LossKind::kMean, "mean"},
                                      {LossKind::kMse, "mse"},
                                      {LossKind::kCrossEntropy, "cross_entropy"},
                                      {LossKind::kSoftCrossEntropy, "soft_cross_entropy"}};
const EnumName<FailMode> kFailModes[] = {{FailMode::kError, "error"}, {FailMode::kExit, "exit"},
                                         {FailMode::kSignal, "signal"}};
const EnumName<FailAt> kFailAts[] = {{FailAt::kStep, "step"}, {FailAt::kBeforeIndex, "before_index"}};
const EnumName<Inject> kInjects[] = {
    {Inject::kNone, "none"},
    {Inject::kGradX2, "grad_x2"},
    {Inject::kMicrobatchOffByOne, "microbatch_off_by_one"},
    {Inject::kNanGrad, "nan_grad"},
    {Inject::kSkipCollective, "skip_collective"},
    {Inject::kNoDocumentMask, "no_document_mask"},
    {Inject::kModuleOutput, "module_output"},
    {Inject::kModuleGrad, "module_grad"}};
const EnumName<OnNonFinite> kOnNonFinite[] = {{OnNonFinite::kStop, "stop"}, {OnNonFinite::kSkip, "skip"}};
const EnumName<Fp8Recipe> kFp8Recipes[] = {{Fp8Recipe::kTensorwise, "tensorwise"}};
const EnumName<DataSource> kSources[] = {
    {DataSource::kSynthetic, "synthetic"}, {DataSource::kFile, "file"}, {DataSource::kTokens, "tokens"}};
const EnumName<TokenDType> kTokenDTypes[] = {{TokenDType::kUint16, "uint16"}, {TokenDType::kUint32, "uint32"}};
const EnumName<InputKind> kInputs[] = {{InputKind::kAuto, "auto"},
                                       {InputKind::kNormal, "normal"},
                                       {InputKind::kUniform, "uniform"},
                                       {InputKind::kTokens, "tokens"}};
const EnumName<TargetKind> kTargets[] = {{TargetKind::kAuto, "auto"},       {TargetKind::kNone, "none"},
                                         {TargetKind::kNormal, "normal"},   {TargetKind::kUniform, "uniform"},
                                         {TargetKind::kTokens, "tokens"},   {TargetKind::kNextTokens, "next_tokens"}};

// ---- model ---------------------------------------------------------------

models::ArgValue read_arg(YamlMap& m, const models::ArgSpec& spec) {
  switch (spec.type) {
    case models::ArgType::kInt: return m.convert<int64_t>(m.node(spec.name), m.child_path(spec.name));
    case models::ArgType::kFloat: return m.convert<double>(m.node(spec.name), m.child_path(spec.name));
    case models::ArgType::kBool: return m.convert<bool>(m.node(spec.name), m.child_path(spec.name));
    case models::ArgType::kString: return m.convert<std::string>(m.node(spec.name), m.child_path(spec.name));
  }
  return int64_t{0};
}

ModelConfig read_model(YamlMap& root) {
  if (!root.has("model")) throw ConfigError(root.self_ref(), "missing required key 'model'");
  YamlMap m(root.node("model"), "model", root.context());
  ModelConfig c;
  c.ref = m.self_ref();
  m.require("name", c.name);
  const models::ModelSpec* spec = models::find_model(c.name);
  if (!spec) {
    auto names = models::model_names();
    std::string hint = nearest(c.name, names);
    throw ConfigError(m.ref("name"), "unknown model '" + c.name + "'" +
                                         (hint.empty() ? "" : "; did you mean " + hint + "?") +
                                         " known models: " + YamlMap::join(names));
  }
  m.get("init_from", c.init_from);
  if (m.has("init_from")) c.init_from_ref = m.ref("init_from");
  m.get("from_hf", c.from_hf);
  const bool hf = m.has("from_hf");
  if (hf) {
    c.from_hf_ref = m.ref("from_hf");
    if (c.name != "llama") {
      throw ConfigError(m.ref("name"), "from_hf reads a Hugging Face Llama or Mixtral folder into model llama, not " +
                                           c.name + "; set model.name: llama");
    }
    if (m.has("init_from")) {
      throw ConfigError(m.ref("init_from"), "init_from and from_hf both give the initial weights; keep one");
    }
  }
  YamlMap args(m.has("args") ? m.node("args") : YAML::Node(), "model.args", root.context());
  for (const auto& a : spec->args) {
    if (hf && args.has(a.name) && a.name != "max_seq_len") {
      throw ConfigError(args.ref(a.name), "this argument comes from from_hf's config.json; remove it (only "
                                          "max_seq_len may be given, to shorten the rotary tables)");
    }
    c.args.set(a.name, args.has(a.name) ? read_arg(args, a) : a.default_value);
  }
  args.finish();
  m.finish();
  if (hf) {
    naming_config_key(c.from_hf_ref, [&] { read_hf_llama_config(c.from_hf, c.args, args.has("max_seq_len")); });
  }
  if (spec->check) {
    try {
      spec->check(c.args);
    } catch (const models::ArgError& e) {
      throw ConfigError(args.has(e.arg()) ? args.ref(e.arg()) : args.self_ref(), e.what());
    }
  }
  return c;
}

// The optional top-level section `key` (empty when absent).
YamlMap section(YamlMap& root, const std::string& key) {
  return YamlMap(root.has(key) ? root.node(key) : YAML::Node(), key, root.context());
}

// ---- mesh and parallelize ------------------------------------------------

MeshConfig read_mesh(YamlMap& root) {
  YamlMap m = section(root, "mesh");
  MeshConfig c;
  c.ref = m.self_ref();
  m.get("shape", c.shape);
  m.get("names", c.names);
  m.get_enum("device", c.device, kDevices);
  c.backend = c.device == DeviceKind::kCuda ? Backend::kNccl : Backend::kGloo;
  m.get_enum("backend", c.backend, kBackends);
  m.get("timeout_s", c.timeout_s);
  require_positive(m.ref("timeout_s"), c.timeout_s, "timeout_s");
  m.get("memory_per_rank_mb", c.memory_per_rank_mb);
  require_non_negative(m.ref("memory_per_rank_mb"), c.memory_per_rank_mb, "memory_per_rank_mb");
  m.finish();
  if (c.shape.size() != c.names.size()) {
    throw ConfigError(m.ref("names"), "mesh has " + std::to_string(c.shape.size()) + " dims in shape but " +
                                          std::to_string(c.names.size()) + " names; give one name per dim");
  }
  for (size_t i = 0; i < c.shape.size(); ++i) {
    require_positive(m.ref("shape"), static_cast<double>(c.shape[i]), "mesh.shape[" + std::to_string(i) + "]");
    for (size_t j = 0; j < i; ++j) {
      if (c.names[i] == c.names[j]) throw ConfigError(m.ref("names"), "mesh dim name '" + c.names[i] + "' repeats");
    }
  }
  return c;
}

// ---- train, data, check --------------------------------------------------

OptimizerConfig read_optimizer(YamlMap& train) {
  YamlMap m(train.has("optimizer") ? train.node("optimizer") : YAML::Node(), "train.optimizer",
            train.context());
  OptimizerConfig c;
  m.get_enum("name", c.name, kOptimizers);
  m.get("lr", c.lr);
  require_non_negative(m.ref("lr"), c.lr, "lr");
  m.get("momentum", c.momentum);
  require_non_negative(m.ref("momentum"), c.momentum, "momentum");
  m.get("dampening", c.dampening);
  m.get("nesterov", c.nesterov);
  m.get("weight_decay", c.weight_decay);
  require_non_negative(m.ref("weight_decay"), c.weight_decay, "weight_decay");
  m.get("betas", c.betas);
  if (c.betas.size() != 2 || c.betas[0] < 0 || c.betas[0] >= 1 || c.betas[1] < 0 || c.betas[1] >= 1) {
    throw ConfigError(m.ref("betas"), "betas must be two numbers in [0, 1), e.g. [0.9, 0.999]");
  }
  m.get("eps", c.eps);
  require_positive(m.ref("eps"), c.eps, "eps");
  if (c.nesterov && (c.momentum <= 0 || c.dampening != 0)) {
    throw ConfigError(m.ref("nesterov"), "nesterov needs momentum > 0 and dampening 0");
  }
  m.finish();
  return c;
}

TrainConfig read_train(YamlMap& root) {
  YamlMap m = section(root, "train");
  TrainConfig c;
  m.get("steps", c.steps);
  require_positive(m.ref("steps"), static_cast<double>(c.steps), "steps");
  m.get("global_batch", c.global_batch);
  require_positive(m.ref("global_batch"), static_cast<double>(c.global_batch), "global_batch");
  m.get("microbatches", c.microbatches);
  require_positive(m.ref("microbatches"), static_cast<double>(c.microbatches), "microbatches");
  read_dtype(m, "dtype", c.dtype);
  if (c.dtype == DType::kFloat16) {
    throw ConfigError(m.ref("dtype"),
                      "float16 parameters and optimizer state underflow (Adam's eps 1e-8 is 0 in "
                      "float16); train in float32 and compute in float16 with fully_shard's "
                      "param_dtype: float16");
  }
  c.optimizer = read_optimizer(m);
  {
    YamlMap s(m.has("lr_schedule") ? m.node("lr_schedule") : YAML::Node(), "train.lr_schedule", root.context());
    s.get("warmup_steps", c.lr_schedule.warmup_steps);
    require_non_negative(s.ref("warmup_steps"), static_cast<double>(c.lr_schedule.warmup_steps), "warmup_steps");
    s.get_enum("decay", c.lr_schedule.decay, kDecays);
    s.get("min_lr", c.lr_schedule.min_lr);
    require_non_negative(s.ref("min_lr"), c.lr_schedule.min_lr, "min_lr");
    s.finish();
  }
  {
    YamlMap l(m.has("loss") ? m.node("loss") : YAML::Node(), "train.loss", root.context());
    l.get_enum("name", c.loss.name, kLosses);
    l.get("scale", c.loss.scale);
    l.finish();
  }
  m.get("grad_clip", c.grad_clip);
  require_non_negative(m.ref("grad_clip"), c.grad_clip, "grad_clip");
  m.get("log_every", c.log_every);
  require_positive(m.ref("log_every"), static_cast<double>(c.log_every), "log_every");
  m.get("threads", c.threads);
  require_non_negative(m.ref("threads"), static_cast<double>(c.threads), "threads");
  m.get_enum("on_nonfinite", c.on_nonfinite, kOnNonFinite);
  m.get("max_skipped", c.max_skipped);
  require_positive(m.ref("max_skipped"), static_cast<double>(c.max_skipped), "max_skipped");
  if (m.has("fp8")) {
    c.fp8.enabled = true;
    c.fp8.ref = c.fp8.modules_ref = m.ref("fp8");
    YamlMap f(m.node("fp8"), "train.fp8", root.context());
    f.get_enum("recipe", c.fp8.recipe, kFp8Recipes);
    if (f.has("modules")) {
      c.fp8.modules_ref = f.ref("modules");
      f.get("modules", c.fp8.modules);
      if (c.fp8.modules.empty()) {
        throw ConfigError(c.fp8.modules_ref, "train.fp8.modules is empty; name the modules whose Linear layers "
                                             "compute in float8 (e.g. ['layers.*']), or remove train.fp8");
      }
    }
    f.finish();
  }
  m.finish();
  if (c.global_batch % c.microbatches != 0) {
    throw ConfigError(m.ref("microbatches"), "microbatches " + std::to_string(c.microbatches) +
                                                 " does not divide global_batch " +
                                                 std::to_string(c.global_batch) +
                                                 "; use a divisor of global_batch");
  }
  return c;
}

DataConfig read_data(YamlMap& root) {
  YamlMap m = section(root, "data");
  DataConfig c;
  m.get_enum("source", c.source, kSources);
  m.get_enum("inputs", c.inputs, kInputs);
  m.get_enum("targets", c.targets, kTargets);
  m.get("seq_len", c.seq_len);
  require_non_negative(m.ref("seq_len"), static_cast<double>(c.seq_len), "seq_len");
  m.get("path", c.path);
  if (m.has("path")) c.path_ref = m.ref("path");
  if (c.source == DataSource::kFile && c.path.empty()) {
    throw ConfigError(m.self_ref(), "data.source file needs data.path (a safetensors file with inputs and targets)");
  }
  c.sources = read_token_sources(m, c.source == DataSource::kTokens, "data");
  if (c.source == DataSource::kTokens && c.path.empty() && c.sources.empty()) {
    throw ConfigError(m.self_ref(), "data.source tokens needs data.path (a flat file of uint16 or uint32 token ids) "
                                    "or data.sources (several, blended by weight)");
  }
  if (m.has("token_dtype") && c.source != DataSource::kTokens) {
    throw ConfigError(m.ref("token_dtype"), "data.token_dtype is only read with data.source: tokens; remove it");
  }
  m.get_enum("token_dtype", c.token_dtype, kTokenDTypes);
  if (c.source == DataSource::kSynthetic && !c.path.empty()) {
    throw ConfigError(m.ref("path"), "data.path is only read with data.source: file; set source: file or remove path");
  }
  c.documents = read_documents(m, c.source == DataSource::kTokens);
  m.finish();
  return c;
}

// data.documents.eos_id against the model's vocabulary: an id the model never sees would end no document.
void check_eos_id(const ModelConfig& model, const DocumentsConfig& d) {
  const auto& args = model.args.values();
  const auto vocab = args.find("vocab_size");
  if (d.eos_id < 0 || vocab == args.end() || !std::holds_alternative<int64_t>(vocab->second)) return;
  const int64_t size = std::get<int64_t>(vocab->second);
  if (d.eos_id < size) return;
  const std::string from =
      model.from_hf.empty() ? "model.args.vocab_size" : "vocab_size in " + model.from_hf + "/config.json";
  throw ConfigError(d.eos_id_ref, "eos_id " + std::to_string(d.eos_id) + " is not a token id of model " + model.name +
                                      ", whose vocab_size is " + std::to_string(size) + " (" + from + ", ids 0 to " +
                                      std::to_string(size - 1) +
                                      "); give the id that ends each document in the "
                                      "token files, or leave eos_id out to read each file's document index");
}

CheckConfig read_check(YamlMap& root) {
  YamlMap m = section(root, "check");
  CheckConfig c;
  m.get("golden", c.golden);
  c.golden_ref = m.has("golden") ? m.ref("golden") : root.ref("name");
  for (auto [key, field] : {std::pair<const char*, double*>{"loss_rtol", &c.loss_rtol},
                            {"loss_atol", &c.loss_atol},
                            {"param_rtol", &c.param_rtol},
                            {"param_atol", &c.param_atol}}) {
    m.get(key, *field);
    require_non_negative(m.ref(key), *field, key);
  }
  m.finish();
  return c;
}

CheckpointConfig read_checkpoint(YamlMap& root) {
  YamlMap m = section(root, "checkpoint");
  CheckpointConfig c;
  c.ref = m.self_ref();
  m.get("enabled", c.enabled);
  m.get("dir", c.dir);
  if (m.has("dir")) c.dir_ref = m.ref("dir");
  m.get("interval", c.interval);
  require_non_negative(m.ref("interval"), static_cast<double>(c.interval), "interval");
  m.get("keep_latest_k", c.keep_latest_k);
  if (c.keep_latest_k < 2) {
    throw ConfigError(m.ref("keep_latest_k"), "keep_latest_k must be at least 2, so a complete checkpoint survives "
                                              "while the next is written");
  }
  m.get("resume", c.resume);
  c.resume_ref = m.has("resume") ? m.ref("resume") : m.self_ref();
  m.get("async", c.async_save);
  if (c.resume.empty()) throw ConfigError(c.resume_ref, "resume must be auto, never or the path of a checkpoint");
  if (!c.enabled) {  // a key that would do nothing
    for (const char* key : {"dir", "interval", "keep_latest_k", "resume", "async"}) {
      if (m.has(key) && !(std::string(key) == "resume" && c.resume == "never")) {
        throw ConfigError(m.ref(key), std::string(key) + " has no effect with enabled: false (nothing is saved or "
                                                         "resumed); remove it, or set enabled: true");
      }
    }
  }
  m.finish();
  return c;
}

EvalConfig read_eval(YamlMap& root, const DataConfig& train_data) {
  YamlMap m = section(root, "eval");
  EvalConfig c;
  c.ref = m.self_ref();
  m.get("every", c.every);
  require_non_negative(m.ref("every"), static_cast<double>(c.every), "every");
  m.get("batches", c.batches);
  require_positive(m.ref("batches"), static_cast<double>(c.batches), "batches");
  m.get("global_batch", c.global_batch);
  m.get("seq_len", c.seq_len);
  for (const char* key : {"global_batch", "seq_len"}) {
    if (!m.has(key)) continue;
    require_positive(m.ref(key), static_cast<double>(std::string(key) == "seq_len" ? c.seq_len : c.global_batch), key);
    if (c.every == 0) {
      throw ConfigError(m.ref(key), std::string("eval.") + key + " is read only when eval.every is set; set "
                                                                 "eval.every: N");
    }
  }
  c.global_batch_ref = m.has("global_batch") ? m.ref("global_batch") : c.ref;
  c.seq_len_ref = m.has("seq_len") ? m.ref("seq_len") : c.ref;
  c.data = train_data;
  if (m.has("data")) {
    YamlMap d(m.node("data"), "eval.data", root.context());
    c.has_data = true;
    c.data.source = DataSource::kSynthetic;
    c.data.path.clear();
    c.data.path_ref = {};
    d.get_enum("source", c.data.source, kSources);
    d.get("path", c.data.path);
    if (d.has("path")) c.data.path_ref = d.ref("path");
    c.data.sources = read_token_sources(d, c.data.source == DataSource::kTokens, "eval.data");
    if (c.data.source != DataSource::kSynthetic && c.data.path.empty() && c.data.sources.empty()) {
      throw ConfigError(d.self_ref(), "eval.data.source " + std::string(name_of(c.data.source)) +
                                          " needs eval.data.path (the held-out file)");
    }
    if (c.data.source == DataSource::kSynthetic && !c.data.path.empty()) {
      throw ConfigError(d.ref("path"), "eval.data.path is only read with source file or tokens; set source or remove path");
    }
    if (d.has("token_dtype") && c.data.source != DataSource::kTokens) {
      throw ConfigError(d.ref("token_dtype"), "eval.data.token_dtype is only read with source: tokens; remove it");
    }
    d.get_enum("token_dtype", c.data.token_dtype, kTokenDTypes);
    for (const auto* key : {"inputs", "targets"}) {
      if (d.has(key)) {
        throw ConfigError(d.ref(key), std::string("eval.data.") + key + " is the training data's (data." + key +
                                          "): the model's loss is computed on them; remove it");
      }
    }
    if (d.has("seq_len")) {
      throw ConfigError(d.ref("seq_len"), "eval's tokens per sample is eval.seq_len, beside eval.every; move it there");
    }
    d.finish();
    if (c.every == 0) {
      throw ConfigError(m.ref("data"), "eval.data is read only when eval.every is set; set eval.every: N");
    }
  }
  m.finish();
  return c;
}

MetricsConfig read_metrics(YamlMap& root) {
  YamlMap m = section(root, "metrics");
  MetricsConfig c;
  m.get("tensorboard", c.tensorboard);
  if (m.has("tensorboard")) c.tensorboard_ref = m.ref("tensorboard");
#if !COMPOSER_TENSORBOARD
  if (!c.tensorboard.empty()) {
    throw ConfigError(m.ref("tensorboard"), "this composer was built without TensorBoard event files (protobuf, "
                                            "protoc or python's tensorboard package was missing when CMake "
                                            "configured it); run tools/setup and rebuild, or remove the key");
  }
#endif
  m.get("straggler_factor", c.straggler_factor);
  if (!(c.straggler_factor > 1)) {
    std::ostringstream os;
    os << "straggler_factor must be above 1 (a rank this many times the median compute time is named), got "
       << c.straggler_factor << "; give e.g. 1.5";
    throw ConfigError(m.ref("straggler_factor"), os.str());
  }
  m.get("straggler_steps", c.straggler_steps);
  require_positive(m.ref("straggler_steps"), static_cast<double>(c.straggler_steps), "straggler_steps");
  m.get("flight_recorder", c.flight_recorder);
  require_non_negative(m.ref("flight_recorder"), static_cast<double>(c.flight_recorder), "flight_recorder");
  if (c.flight_recorder > (1 << 20)) {
    throw ConfigError(m.ref("flight_recorder"), "flight_recorder keeps at most 1048576 operations per rank");
  }
  m.finish();
  return c;
}

LaunchConfig read_launch(YamlMap& root) {
  YamlMap m = section(root, "launch");
  LaunchConfig c;
  c.ref = m.self_ref();
  m.get("max_restarts", c.max_restarts);
  require_non_negative(m.ref("max_restarts"), static_cast<double>(c.max_restarts), "max_restarts");
  m.get("restart_wait_s", c.restart_wait_s);
  require_non_negative(m.ref("restart_wait_s"), c.restart_wait_s, "restart_wait_s");
  m.finish();
  return c;
}

ProfileConfig read_profile(YamlMap& root, int64_t steps) {
  YamlMap m = section(root, "profile");
  ProfileConfig c;
  m.get("steps", c.steps);
  m.get("dir", c.dir);
  if (m.has("dir")) c.dir_ref = m.ref("dir");
  if (m.has("steps")) {
    const bool ok = c.steps.size() == 2 && c.steps[0] >= 1 && c.steps[0] <= c.steps[1] && c.steps[1] <= steps;
    if (!ok) {
      throw ConfigError(m.ref("steps"), "steps must be [first, last] with 1 <= first <= last <= train.steps (" +
                                            std::to_string(steps) + "), e.g. [" + std::to_string(std::min<int64_t>(2, steps)) +
                                            ", " + std::to_string(std::min<int64_t>(3, steps)) + "]");
    }
  }
  m.finish();
  return c;
}

DebugConfig read_debug(YamlMap& root, int64_t world_size, bool documents) {
  YamlMap m = section(root, "debug");
  DebugConfig c;
  m.get("fail_rank", c.fail_rank);
  m.get("fail_step", c.fail_step);
  m.get("fail_attempts", c.fail_attempts);
  require_positive(m.ref("fail_attempts"), static_cast<double>(c.fail_attempts), "fail_attempts");
  m.get_enum("fail_mode", c.fail_mode, kFailModes);
  m.get_enum("fail_at", c.fail_at, kFailAts);
  m.get_enum("inject", c.inject, kInjects);
  m.get("inject_step", c.inject_step);
  require_positive(m.ref("inject_step"), static_cast<double>(c.inject_step), "inject_step");
  m.get("inject_rank", c.inject_rank);
  if (c.inject_rank < 0 || c.inject_rank >= world_size) {
    throw ConfigError(m.ref("inject_rank"), "inject_rank " + std::to_string(c.inject_rank) + " is not a rank of the " +
                                                std::to_string(world_size) + "-rank mesh; use 0 .. " +
                                                std::to_string(world_size - 1));
  }
  if (c.inject == Inject::kNoDocumentMask && !documents) {
    throw ConfigError(m.ref("inject"), "no_document_mask drops data.documents' mask, and this run packs no "
                                       "documents; set data.documents: {mask: true} or inject another fault");
  }
  if (c.inject == Inject::kSkipCollective && world_size < 2) {
    throw ConfigError(m.ref("inject"), "skip_collective leaves out a collective, which needs a mesh of at least 2 "
                                       "ranks; give mesh.shape more ranks or remove it");
  }
  const bool by_module = c.inject == Inject::kModuleOutput || c.inject == Inject::kModuleGrad;
  if (m.has("inject_module")) {
    m.get("inject_module", c.inject_module);
    c.inject_module_ref = m.ref("inject_module");
    if (!by_module) {
      throw ConfigError(c.inject_module_ref, "inject_module names the module that inject: module_output or "
                                             "module_grad perturbs; set one of them or remove inject_module");
    }
  } else if (by_module) {
    throw ConfigError(m.ref("inject"), std::string(name_of(c.inject)) + " perturbs one module: name it with "
                                           "inject_module (its FQN, e.g. layers.0.attention.wo)");
  }
  if (m.has("delay")) c.delay = read_delays(m.node("delay"), m.child_path("delay"), m.context(), world_size);
  require_positive(m.ref("fail_step"), static_cast<double>(c.fail_step), "fail_step");
  m.finish();
  return c;
}

}  // namespace

const char* name_of(Backend v) { return lookup(kBackends, v); }
const char* name_of(DeviceKind v) { return lookup(kDevices, v); }
const char* name_of(OptimizerKind v) { return lookup(kOptimizers, v); }
const char* name_of(Decay v) { return lookup(kDecays, v); }
const char* name_of(LossKind v) { return lookup(kLosses, v); }
const char* name_of(DataSource v) { return lookup(kSources, v); }
const char* name_of(TokenDType v) { return lookup(kTokenDTypes, v); }
const char* name_of(InputKind v) { return lookup(kInputs, v); }
const char* name_of(TargetKind v) { return lookup(kTargets, v); }
const char* name_of(OnNonFinite v) { return lookup(kOnNonFinite, v); }
const char* name_of(Fp8Recipe v) { return lookup(kFp8Recipes, v); }
const char* name_of(FailMode v) { return lookup(kFailModes, v); }
const char* name_of(FailAt v) { return lookup(kFailAts, v); }
const char* name_of(Inject v) { return lookup(kInjects, v); }

int64_t MeshConfig::world_size() const {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

ExperimentConfig parse_config(const std::string& text, const std::string& file,
                              const std::vector<std::string>& overrides) {
  ReadContext ctx{file, {}};
  YAML::Node doc;
  try {
    doc = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {  // the parser's own bound, met before ours
    SourceRef r{file, e.mark.line + 1, e.mark.column + 1, "", ""};
    throw ConfigError(r, "the config nests deeper than " + std::to_string(e.depth()) + " levels here (lists or mappings "
                         "inside each other); a config may nest at most " + std::to_string(kMaxConfigDepth) +
                         " levels: write the values out flatter");
  } catch (const YAML::ParserException& e) {
    SourceRef r{file, e.mark.line + 1, e.mark.column + 1, "", ""};
    throw ConfigError(r, "malformed YAML: " + e.msg);
  }
  if (!doc.IsMap()) {
    throw ConfigError(SourceRef{file, 1, 1, "", ""},
                      "expected a mapping with the sections name, seed, model, mesh, parallelize, train, data, check");
  }
  check_unique_keys(doc, file);
  for (const auto& o : overrides) apply_override(doc, o, ctx);

  YamlMap root(doc, "", ctx);
  ExperimentConfig c;
  c.file = file;
  root.require("name", c.name);
  if (c.name.empty() || c.name.find('/') != std::string::npos) {
    throw ConfigError(root.ref("name"), "name must be a non-empty file name without '/'");
  }
  root.get("seed", c.seed);
  c.model = read_model(root);
  c.mesh = read_mesh(root);
  c.parallelize = read_parallelize(root);
  c.train = read_train(root);
  c.data = read_data(root);
  check_eos_id(c.model, c.data.documents);
  c.check = read_check(root);
  c.checkpoint = read_checkpoint(root);
  c.eval = read_eval(root, c.data);
  c.metrics = read_metrics(root);
  c.profile = read_profile(root, c.train.steps);
  c.launch = read_launch(root);
  c.debug = read_debug(root, c.mesh.world_size(), c.data.documents.active());
  root.finish();
  return c;
}

ExperimentConfig eval_data_config(const ExperimentConfig& c) {
  ExperimentConfig e = c;
  e.data = c.eval.data;
  if (c.eval.seq_len) e.data.seq_len = c.eval.seq_len;
  if (c.eval.global_batch) e.train.global_batch = c.eval.global_batch;  // a sample's global index counts in eval batches
  e.seed = c.seed ^ 0x6576616c2d736565ull;  // eval's own samples and windows, not training's
  return e;
}

ExperimentConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) throw FileError(path, "cannot read the config file; check the path");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path, overrides);
}

}  // namespace composer

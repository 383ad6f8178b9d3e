// The sections' check()s: the refusals of combinations within a section and
// the defaults that depend on another of its keys (runner/config/field_walk.h
// runs each after the section's fields are read, with the keys given).
#include <sstream>

#include "runner/config/config.h"

namespace composer {

std::optional<FieldError> MeshConfig::check(const std::set<std::string>& given) {
  if (!given.count("backend")) backend = device == DeviceKind::kCuda ? Backend::kNccl : Backend::kGloo;
  if (shape.size() != names.size()) {
    return FieldError{"names", "mesh has " + std::to_string(shape.size()) + " dims in shape but " +
                                   std::to_string(names.size()) + " names; give one name per dim"};
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (!(shape[i] > 0)) {
      std::ostringstream os;
      os << "mesh.shape[" << i << "] must be positive, got " << static_cast<double>(shape[i]);
      return FieldError{"shape", os.str()};
    }
    for (size_t j = 0; j < i; ++j) {
      if (names[i] == names[j]) return FieldError{"names", "mesh dim name '" + names[i] + "' repeats"};
    }
  }
  return std::nullopt;
}

std::optional<FieldError> MuonConfig::check(const std::set<std::string>&) {
  if (ns_coefficients.size() != 3) {
    return FieldError{"ns_coefficients", "ns_coefficients must be three numbers (a, b, c), e.g. [3.4445, -4.775, 2.0315]"};
  }
  if (ns_dtype != DType::kBFloat16 && ns_dtype != DType::kFloat32) {
    return FieldError{"ns_dtype", "ns_dtype is bfloat16 (torch.optim.Muon's) or float32"};
  }
  if (ns_steps >= 100) {
    return FieldError{"ns_steps", "ns_steps " + std::to_string(ns_steps) + " is 100 or more; use fewer (5 is the default)"};
  }
  return std::nullopt;
}

std::optional<FieldError> OptimizerConfig::check(const std::set<std::string>& given) {
  if (name != OptimizerKind::kMuon && muon) {
    return FieldError{"muon", "optimizer.muon holds Muon's options; set optimizer.name: muon, or remove optimizer.muon"};
  }
  if (name == OptimizerKind::kMuon) {
    if (!muon) muon = MuonConfig{};  // its defaults, in the resolved config for tools to read
    for (const char* key : {"momentum", "dampening", "nesterov"}) {
      if (given.count(key)) {
        return FieldError{key, std::string("optimizer.") + key + " is sgd's; Muon's momentum and nesterov are "
                               "optimizer.muon.momentum and optimizer.muon.nesterov"};
      }
    }
    if (muon && muon->lr > 0 && lr == 0) {
      std::ostringstream os;
      os << "optimizer.lr is 0 while optimizer.muon.lr is " << muon->lr
         << ": the schedule scales both by lr's, so set lr > 0 (the AdamW parameters' lr)";
      return FieldError{"lr", os.str()};
    }
  }
  if (betas.size() != 2 || betas[0] < 0 || betas[0] >= 1 || betas[1] < 0 || betas[1] >= 1) {
    return FieldError{"betas", "betas must be two numbers in [0, 1), e.g. [0.9, 0.999]"};
  }
  if (nesterov && (momentum <= 0 || dampening != 0)) {
    return FieldError{"nesterov", "nesterov needs momentum > 0 and dampening 0"};
  }
  return std::nullopt;
}

std::optional<FieldError> Fp8Config::check(const std::set<std::string>& given) {
  if (!given.count("modules")) modules_ref = ref;
  if (given.count("modules") && modules.empty()) {
    return FieldError{"modules", "train.fp8.modules is empty; name the modules whose Linear layers compute in "
                                 "float8 (e.g. ['layers.*']), or remove train.fp8"};
  }
  return std::nullopt;
}

std::optional<FieldError> LoraConfig::check(const std::set<std::string>&) {
  if (dropout >= 1) return FieldError{"dropout", "train.lora.dropout is a probability below 1 (0 for none)"};
  if (targets.empty()) {
    return FieldError{"targets", "train.lora.targets is empty; name the modules whose Linear layers get adapters "
                                 "(e.g. ['layers.*.attention.wq', 'layers.*.attention.wv'])"};
  }
  return std::nullopt;
}

std::optional<FieldError> TrainConfig::check(const std::set<std::string>&) {
  if (dtype == DType::kFloat16) {
    return FieldError{"dtype",
                      "float16 parameters and optimizer state underflow (Adam's eps 1e-8 is 0 in float16); train "
                      "in float32 and compute in float16 with fully_shard's param_dtype: float16"};
  }
  if (global_batch % microbatches != 0) {
    return FieldError{"microbatches", "microbatches " + std::to_string(microbatches) + " does not divide global_batch " +
                                          std::to_string(global_batch) + "; use a divisor of global_batch"};
  }
  return std::nullopt;
}

std::optional<FieldError> DataConfig::check(const std::set<std::string>& given) {
  const bool tokens = source == DataSource::kTokens;
  if (source == DataSource::kFile && path.empty()) {
    return FieldError{"", "data.source file needs data.path (a safetensors file with inputs and targets)"};
  }
  if (auto e = sources_error(given, tokens, "data")) return e;
  if (tokens && path.empty() && sources.empty()) {
    return FieldError{"", "data.source tokens needs data.path (a flat file of uint16 or uint32 token ids) or "
                          "data.sources (several, blended by weight)"};
  }
  if (given.count("token_dtype") && !tokens) {
    return FieldError{"token_dtype", "data.token_dtype is only read with data.source: tokens; remove it"};
  }
  if (tokens && !token_dtype) token_dtype = TokenDType::kUint16;
  if (source == DataSource::kSynthetic && !path.empty()) {
    return FieldError{"path", "data.path is only read with data.source: file; set source: file or remove path"};
  }
  if (given.count("documents") && !tokens) {
    return FieldError{"documents", "data.documents packs the documents of token files; set data.source: tokens or "
                                   "remove documents"};
  }
  if (loss_mask && !tokens) {
    return FieldError{"loss_mask", "data.loss_mask reads each token file's <path>.mask; set data.source: tokens or "
                                   "remove loss_mask"};
  }
  if (given.count("documents") && !documents.mask) {
    return FieldError{"documents", "data.documents without mask: true changes nothing (windows run across "
                                   "documents, as without it); set mask: true or remove documents"};
  }
  return std::nullopt;
}

std::optional<FieldError> EvalDataConfig::check(const std::set<std::string>& given) {
  const bool tokens = source == DataSource::kTokens;
  if (auto e = sources_error(given, tokens, "eval.data")) return e;
  if (source != DataSource::kSynthetic && path.empty() && sources.empty()) {
    return FieldError{"", "eval.data.source " + std::string(name_of(source)) +
                              " needs eval.data.path (the held-out file)"};
  }
  if (source == DataSource::kSynthetic && !path.empty()) {
    return FieldError{"path", "eval.data.path is only read with source file or tokens; set source or remove path"};
  }
  if (given.count("token_dtype") && !tokens) {
    return FieldError{"token_dtype", "eval.data.token_dtype is only read with source: tokens; remove it"};
  }
  return std::nullopt;
}

std::optional<FieldError> CheckpointConfig::check(const std::set<std::string>& given) {
  if (!given.count("resume")) resume_ref = ref;
  if (keep_latest_k < 2) {
    return FieldError{"keep_latest_k", "keep_latest_k must be at least 2, so a complete checkpoint survives while "
                                       "the next is written"};
  }
  if (resume.empty()) return FieldError{"resume", "resume must be auto, never or the path of a checkpoint"};
  if (given.count("resume_from_dcp") && resume_from_dcp.empty()) {
    return FieldError{"resume_from_dcp", "resume_from_dcp names a PyTorch Distributed Checkpoint folder (a "
                                         "step-N holding .metadata); remove it to start afresh"};
  }
  if (!resume_from_dcp.empty() && resume != "auto") {
    return FieldError{"resume_from_dcp", "resume_from_dcp starts from a DCP checkpoint when dir holds none of "
                                         "composer's, which takes resume: auto (given: " + resume + "); remove resume "
                                         "or resume_from_dcp"};
  }
  if (enabled) return std::nullopt;
  for (const char* key : {"dir", "interval", "keep_latest_k", "resume", "resume_from_dcp", "async"}) {  // a key that would do nothing
    if (given.count(key) && !(std::string(key) == "resume" && resume == "never")) {
      return FieldError{key, std::string(key) + " has no effect with enabled: false (nothing is saved or resumed); "
                                                "remove it, or set enabled: true"};
    }
  }
  return std::nullopt;
}

std::optional<FieldError> EvalConfig::check(const std::set<std::string>& given) {
  if (!given.count("global_batch")) global_batch_ref = ref;
  if (!given.count("seq_len")) seq_len_ref = ref;
  for (const char* key : {"global_batch", "seq_len"}) {
    if (given.count(key) && every == 0) {
      return FieldError{key, std::string("eval.") + key + " is read only when eval.every is set; set eval.every: N"};
    }
  }
  if (data && every == 0) return FieldError{"data", "eval.data is read only when eval.every is set; set eval.every: N"};
  return std::nullopt;
}

std::optional<FieldError> WandbConfig::check(const std::set<std::string>&) {
  if (mode != "online" && mode != "offline" && mode != "disabled") {
    return FieldError{"mode", "mode must be online, offline or disabled (given: " + mode + ")"};
  }
  if (project.empty()) return FieldError{"project", "project must name a W&B project"};
  return std::nullopt;
}

std::optional<FieldError> MetricsConfig::check(const std::set<std::string>&) {
#if !COMPOSER_TENSORBOARD
  if (!tensorboard.empty()) {
    return FieldError{"tensorboard", "this composer was built without TensorBoard event files (protobuf, protoc or "
                                     "python's tensorboard package was missing when CMake configured it); run "
                                     "tools/setup and rebuild, or remove the key"};
  }
#endif
  if (!(straggler_factor > 1)) {
    std::ostringstream os;
    os << "straggler_factor must be above 1 (a rank this many times the median compute time is named), got "
       << straggler_factor << "; give e.g. 1.5";
    return FieldError{"straggler_factor", os.str()};
  }
  if (flight_recorder > (1 << 20)) {
    return FieldError{"flight_recorder", "flight_recorder keeps at most 1048576 operations per rank"};
  }
  return std::nullopt;
}

std::optional<FieldError> DebugConfig::check(const std::set<std::string>& given) {
  const bool by_module = inject == Inject::kModuleOutput || inject == Inject::kModuleGrad;
  if (given.count("inject_module") && !by_module) {
    return FieldError{"inject_module", "inject_module names the module that inject: module_output or module_grad "
                                       "perturbs; set one of them or remove inject_module"};
  }
  if (!given.count("inject_module") && by_module) {
    return FieldError{"inject", std::string(name_of(inject)) + " perturbs one module: name it with inject_module "
                                                               "(its FQN, e.g. layers.0.attention.wo)"};
  }
  return std::nullopt;
}

}  // namespace composer

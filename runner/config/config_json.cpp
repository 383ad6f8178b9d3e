// The resolved config as JSON (config.resolved.json, `composer plan`), the
// hash that ties goldens to what they computed, and the golden's path.
#include <sstream>

#include "runner/config/config.h"

namespace composer {

namespace {
nlohmann::json args_json(const models::ModelArgs& args) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& kv : args.values()) {
    const auto& key = kv.first;
    std::visit([&](const auto& x) { j[key] = x; }, kv.second);
  }
  return j;
}
std::string layout_name(const models::Layout& l) {
  return l.sharded ? "shard(" + std::to_string(l.dim) + ")" : std::string("replicate");
}

nlohmann::json options_json(const PipelineConfig& t) {
  return {{"mesh_dim", t.mesh_dim},         {"schedule", name_of(t.schedule)},
          {"microbatches", t.microbatches}, {"virtual_stages", t.virtual_stages},
          {"split_points", t.split_points}, {"layers_per_stage", t.layers_per_stage},
          {"scale_grads", t.scale_grads}};
}

nlohmann::json options_json(const TensorParallelConfig& t) {
  nlohmann::json j = {{"mesh_dim", t.mesh_dim}, {"plan", t.plan}, {"sequence_parallel", t.sequence_parallel},
                      {"loss_parallel", t.loss_parallel}};
  for (const auto& r : t.styles) {
    j["styles"].push_back({{"module", r.pattern}, {"style", name_of(r.style)}, {"input", layout_name(r.input)},
                           {"output", layout_name(r.output)}, {"desired_input", layout_name(r.desired_input)}});
  }
  return j;
}

nlohmann::json options_json(const ContextParallelConfig& t) {
  return {{"mesh_dim", t.mesh_dim}, {"load_balance", t.load_balance}, {"rotate", parallel::name_of(t.rotate)}};
}

nlohmann::json options_json(const ActivationCheckpointingConfig& t) { return {{"units", t.units}, {"every", t.every}}; }

// As written: true (the whole shard group), false (kept gathered) or the group size.
nlohmann::json reshard_json(int64_t size) {
  if (size <= 1) return size == 0;
  return size;
}

nlohmann::json options_json(const FullyShardConfig& t) {
  return {{"mesh_dim", t.mesh_dim}, {"units", t.units}, {"reshard_after_forward", reshard_json(t.reshard_after_forward)},
          {"param_dtype", t.param_dtype ? name_of(*t.param_dtype) : ""},
          {"reduce_dtype", t.reduce_dtype ? name_of(*t.reduce_dtype) : ""},
          {"shard_placement", name_of(t.shard_placement)}, {"all_gather", name_of(t.all_gather)},
          {"offload", name_of(t.offload)}, {"prefetch", t.prefetch}, {"per_rank", t.per_rank},
          {"per_rank_seed", t.per_rank_seed}};
}

nlohmann::json options_json(const ReplicateConfig& t) {
  return {{"mesh_dim", t.mesh_dim}, {"bucket_mb", t.bucket_mb}, {"per_rank", t.per_rank},
          {"per_rank_seed", t.per_rank_seed}};
}

nlohmann::json transform_json(const TransformConfig& t) {
  return {{t.name(), std::visit([](const auto& o) { return options_json(o); }, t.options)}};
}
}  // namespace

nlohmann::json to_json(const ExperimentConfig& c) {
  const auto& t = c.train;
  nlohmann::json j;
  j["name"] = c.name;
  j["seed"] = c.seed;
  j["model"] = {{"name", c.model.name}, {"args", args_json(c.model.args)}, {"init_from", c.model.init_from}};
  if (!c.model.from_hf.empty()) j["model"]["from_hf"] = c.model.from_hf;
  j["mesh"] = {{"shape", c.mesh.shape},
               {"names", c.mesh.names},
               {"device", name_of(c.mesh.device)},
               {"backend", name_of(c.mesh.backend)},
               {"timeout_s", c.mesh.timeout_s},
               {"memory_per_rank_mb", c.mesh.memory_per_rank_mb}};
  j["parallelize"] = nlohmann::json::array();
  for (const auto& p : c.parallelize) j["parallelize"].push_back(transform_json(p));
  j["train"] = {
      {"steps", t.steps},
      {"global_batch", t.global_batch},
      {"microbatches", t.microbatches},
      {"dtype", name_of(t.dtype)},
      {"optimizer",
       {{"name", name_of(t.optimizer.name)}, {"lr", t.optimizer.lr}, {"momentum", t.optimizer.momentum},
        {"dampening", t.optimizer.dampening}, {"nesterov", t.optimizer.nesterov},
        {"weight_decay", t.optimizer.weight_decay}, {"betas", t.optimizer.betas}, {"eps", t.optimizer.eps}}},
      {"lr_schedule",
       {{"warmup_steps", t.lr_schedule.warmup_steps}, {"decay", name_of(t.lr_schedule.decay)},
        {"min_lr", t.lr_schedule.min_lr}}},
      {"loss", {{"name", name_of(t.loss.name)}, {"scale", t.loss.scale}}},
      {"grad_clip", t.grad_clip},
      {"log_every", t.log_every},
      {"threads", t.threads},
      {"on_nonfinite", name_of(t.on_nonfinite)},
      {"max_skipped", t.max_skipped}};
  j["data"] = {{"source", name_of(c.data.source)}, {"inputs", name_of(c.data.inputs)},
               {"targets", name_of(c.data.targets)}, {"seq_len", c.data.seq_len}, {"path", c.data.path}};
  if (c.data.source == DataSource::kTokens) j["data"]["token_dtype"] = name_of(c.data.token_dtype);
  j["check"] = {{"golden", golden_path(c)}, {"loss_rtol", c.check.loss_rtol}, {"loss_atol", c.check.loss_atol},
                {"param_rtol", c.check.param_rtol}, {"param_atol", c.check.param_atol}};
  j["checkpoint"] = {{"enabled", c.checkpoint.enabled}, {"dir", c.checkpoint.dir}, {"interval", c.checkpoint.interval},
                     {"keep_latest_k", c.checkpoint.keep_latest_k}, {"resume", c.checkpoint.resume}};
  j["eval"] = {{"every", c.eval.every}, {"batches", c.eval.batches}};
  if (c.eval.has_data) {
    j["eval"]["data"] = {{"source", name_of(c.eval.data.source)}, {"path", c.eval.data.path}};
    if (c.eval.data.source == DataSource::kTokens) j["eval"]["data"]["token_dtype"] = name_of(c.eval.data.token_dtype);
  }
  j["metrics"] = {{"tensorboard", c.metrics.tensorboard}};
  j["profile"] = {{"steps", c.profile.steps}, {"dir", c.profile.dir}};
  j["debug"] = {{"fail_rank", c.debug.fail_rank},
                {"fail_step", c.debug.fail_step},
                {"fail_mode", name_of(c.debug.fail_mode)},
                {"fail_at", name_of(c.debug.fail_at)},
                {"inject", name_of(c.debug.inject)},
                {"inject_step", c.debug.inject_step},
                {"inject_rank", c.debug.inject_rank},
                {"delay", nlohmann::json::array()}};
  for (const auto& d : c.debug.delay) {
    j["debug"]["delay"].push_back({{"point", parallel::name_of(d.point)}, {"ms", d.ms}, {"ranks", d.ranks}});
  }
  return j;
}

namespace {

std::string hash_of(const ExperimentConfig& c, bool with_steps) {
  nlohmann::json j = to_json(c);
  nlohmann::json part = {{"seed", j["seed"]}, {"model", j["model"]}, {"train", j["train"]}, {"data", j["data"]}};
  // Logging, threading and what a non-finite step would do do not change what is computed.
  part["train"].erase("log_every");
  part["train"].erase("threads");
  part["train"].erase("on_nonfinite");
  part["train"].erase("max_skipped");
  if (!with_steps) part["train"].erase("steps");
  std::string s = part.dump();
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  std::ostringstream os;
  os << std::hex;
  os.width(16);
  os.fill('0');
  os << h;
  return os.str();
}

}  // namespace

std::string config_hash(const ExperimentConfig& c) { return hash_of(c, true); }

std::string resume_hash(const ExperimentConfig& c) { return hash_of(c, false); }

std::string golden_path(const ExperimentConfig& c) {
  return c.check.golden.empty() ? "tests/golden/" + c.name + ".json" : c.check.golden;
}

}  // namespace composer

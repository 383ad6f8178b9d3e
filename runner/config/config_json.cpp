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
  for (const auto& p : c.parallelize) j["parallelize"].push_back(to_json(p.options));
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
  // Only when given, so the hash of every config without it stays what it was.
  if (t.fp8.enabled) j["train"]["fp8"] = {{"recipe", name_of(t.fp8.recipe)}, {"modules", t.fp8.modules}};
  j["data"] = {{"source", name_of(c.data.source)}, {"inputs", name_of(c.data.inputs)},
               {"targets", name_of(c.data.targets)}, {"seq_len", c.data.seq_len}, {"path", c.data.path}};
  if (c.data.source == DataSource::kTokens) j["data"]["token_dtype"] = name_of(c.data.token_dtype);
  // Only when given, so the hash of every config without them stays what it was.
  auto sources_json = [](const std::vector<TokenSource>& sources) {
    auto list = nlohmann::json::array();
    for (const auto& s : sources) list.push_back({{"path", s.path}, {"weight", s.weight}});
    return list;
  };
  if (!c.data.sources.empty()) j["data"]["sources"] = sources_json(c.data.sources);
  if (c.data.documents.active()) {
    j["data"]["documents"] = {{"mask", c.data.documents.mask}, {"eos_id", c.data.documents.eos_id},
                              {"loss_on_boundary", c.data.documents.loss_on_boundary}};
  }
  j["check"] = {{"golden", golden_path(c)}, {"loss_rtol", c.check.loss_rtol}, {"loss_atol", c.check.loss_atol},
                {"param_rtol", c.check.param_rtol}, {"param_atol", c.check.param_atol}};
  j["checkpoint"] = {{"enabled", c.checkpoint.enabled}, {"dir", c.checkpoint.dir}, {"interval", c.checkpoint.interval},
                     {"keep_latest_k", c.checkpoint.keep_latest_k}, {"resume", c.checkpoint.resume},
                     {"async", c.checkpoint.async_save}};
  j["eval"] = {{"every", c.eval.every}, {"batches", c.eval.batches}};
  if (c.eval.global_batch) j["eval"]["global_batch"] = c.eval.global_batch;
  if (c.eval.seq_len) j["eval"]["seq_len"] = c.eval.seq_len;
  if (c.eval.has_data) {
    j["eval"]["data"] = {{"source", name_of(c.eval.data.source)}, {"path", c.eval.data.path}};
    if (c.eval.data.source == DataSource::kTokens) j["eval"]["data"]["token_dtype"] = name_of(c.eval.data.token_dtype);
    if (!c.eval.data.sources.empty()) j["eval"]["data"]["sources"] = sources_json(c.eval.data.sources);
  }
  j["metrics"] = {{"tensorboard", c.metrics.tensorboard},
                  {"straggler_factor", c.metrics.straggler_factor},
                  {"straggler_steps", c.metrics.straggler_steps},
                  {"flight_recorder", c.metrics.flight_recorder}};
  j["launch"] = {{"max_restarts", c.launch.max_restarts}, {"restart_wait_s", c.launch.restart_wait_s}};
  j["profile"] = {{"steps", c.profile.steps}, {"dir", c.profile.dir}};
  j["debug"] = {{"fail_rank", c.debug.fail_rank},
                {"fail_step", c.debug.fail_step},
                {"fail_attempts", c.debug.fail_attempts},
                {"fail_mode", name_of(c.debug.fail_mode)},
                {"fail_at", name_of(c.debug.fail_at)},
                {"inject", name_of(c.debug.inject)},
                {"inject_step", c.debug.inject_step},
                {"inject_rank", c.debug.inject_rank},
                {"inject_module", c.debug.inject_module},
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

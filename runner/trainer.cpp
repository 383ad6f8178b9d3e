#include "runner/trainer.h"

#include <chrono>
#include <fstream>
#include <thread>

#include "models/registry.h"
#include "runner/checkpoint.h"
#include "runner/optim.h"

namespace composer {
namespace {

torch::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::kFloat64: return torch::kDouble;
    case DType::kBFloat16: return torch::kBFloat16;
    default: return torch::kFloat;
  }
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw RuntimeFailure("cannot write " + path);
}

int64_t default_threads(const Plan& plan) {
  int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
  return std::max<int64_t>(1, cores / std::max<int64_t>(1, plan.local_ranks));
}

}  // namespace

models::ModelPtr build_model(const ExperimentConfig& c) {
  const models::ModelSpec* spec = models::find_model(c.model.name);
  TORCH_INTERNAL_ASSERT(spec, "model ", c.model.name, " passed config validation but is not registered");
  torch::manual_seed(c.seed);
  models::ModelPtr model = spec->build(c.model.args);
  if (!c.model.init_from.empty()) load_weights(*model, c.model.init_from);
  return model;
}

nlohmann::json resolved_json(const ExperimentConfig& c, const DataPlan& data) {
  nlohmann::json j = to_json(c);
  j["data"]["inputs"] = name_of(data.inputs);
  j["data"]["targets"] = name_of(data.targets);
  j["data"]["seq_len"] = data.seq_len;
  j["data"]["output_shape"] = data.output_shape;
  j["data"]["features"] = data.input.features;
  j["data"]["vocab_size"] = data.input.vocab_size;
  j["config_hash"] = config_hash(c);
  j["format_version"] = 1;
  return j;
}

TrainResult train(const ExperimentConfig& c, const Plan& plan, const std::string& out_dir) {
  const auto& t = c.train;
  torch::set_num_threads(static_cast<int>(t.threads ? t.threads : default_threads(plan)));
  models::ModelPtr model = build_model(c);
  save_weights(*model, out_dir + "/init.safetensors");
  model->to(scalar_type(t.dtype));
  model->train();

  DataPlan data = plan_data(c, *model);
  write_json(out_dir + "/config.resolved.json", resolved_json(c, data));
  auto dataset = make_dataset(c, data);

  std::vector<torch::Tensor> params;
  for (auto& [name, p] : nn::unique_named_parameters(*model)) params.push_back(p);
  auto optimizer = make_optimizer(t.optimizer, params);

  Metrics metrics(out_dir + "/metrics.jsonl", t.steps, t.log_every, plan.log_prefix);
  TrainResult result;
  const int64_t mb_size = t.global_batch / t.microbatches;
  for (int64_t step = 1; step <= t.steps; ++step) {
    auto start = std::chrono::steady_clock::now();
    StepRecord r;
    r.step = step;
    r.lr = lr_at(t.optimizer, t.lr_schedule, step, t.steps);
    set_lr(*optimizer, r.lr);
    for (auto& p : params) p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none=True)
    for (int64_t mb = 0; mb < t.microbatches; ++mb) {
      Batch b = dataset->batch(step, mb * mb_size, (mb + 1) * mb_size);
      auto loss = compute_loss(t.loss, (*model)(b.inputs), b.targets, mb_size, t.global_batch);
      loss.backward();
      r.loss += loss.item<double>();
    }
    r.grad_norm = grad_norm(params);
    if (t.grad_clip > 0) clip_grads(params, r.grad_norm, t.grad_clip);
    optimizer->step();
    r.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    r.samples_per_s = static_cast<double>(t.global_batch) * 1000.0 / std::max(r.step_ms, 1e-9);
    if (data.inputs == InputKind::kTokens) r.tokens_per_s = r.samples_per_s * static_cast<double>(data.seq_len);
    r.peak_rss_mb = peak_rss_mb();
    metrics.record(r);
    result.steps.push_back(r);
  }
  result.final_params = snapshot_params(*model);
  write_safetensors(out_dir + "/final.safetensors", result.final_params, {{"format", "pt"}});
  return result;
}

}  // namespace composer

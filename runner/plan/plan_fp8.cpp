#include "runner/plan/plan_fp8.h"

#include <set>

#include "models/select.h"
#include "runner/base/errors.h"

namespace composer {

std::vector<std::pair<std::string, nn::Linear*>> fp8_layers(nn::Module& model, const Fp8Config& f) {
  std::vector<std::pair<std::string, nn::Linear*>> out;
  std::set<nn::Module*> seen;
  for (const auto& [name, selected] : models::select_modules(model, f.modules)) {
    for (const auto& [sub, m] : nn::named_modules(*selected)) {
      auto* linear = dynamic_cast<nn::Linear*>(m);
      if (linear && seen.insert(m).second) out.emplace_back(sub.empty() ? name : name + "." + sub, linear);
    }
  }
  return out;
}

std::string plan_fp8(const ExperimentConfig& c, nn::Module& model, int64_t rows_per_microbatch, int64_t tp_size) {
  const Fp8Config& f = c.train.fp8;
  if (!f.enabled) return "";
  const auto layers = fp8_layers(model, f);
  if (layers.empty()) {
    throw PlanError(f.modules_ref, "train.fp8.modules [" + YamlMap::join(f.modules) + "] selects no Linear layer of model " +
                                       c.model.name + "; name modules that hold Linear layers (e.g. 'layers.*')");
  }
  for (const auto& t : c.parallelize) {
    const auto* p = std::get_if<PipelineConfig>(&t.options);
    if (p && (p->schedule == parallel::ScheduleKind::kInterleavedZeroBubble || p->schedule == parallel::ScheduleKind::kZbv)) {
      throw PlanError(f.ref, std::string("train.fp8 with the ") + parallel::name_of(p->schedule) + " schedule: its deferred weight "
                             "gradients would be computed in high precision; use 1f1b or interleaved_1f1b, or remove train.fp8");
    }
  }
  if (c.mesh.device == DeviceKind::kCuda) {
    auto refuse = [&](const std::string& what, int64_t n, const std::string& fix) {
      throw PlanError(f.ref, "train.fp8 on cuda multiplies in float8 through cuBLAS, which needs every matrix dimension "
                             "to be a multiple of 16, but " + what + " is " + std::to_string(n) + "; " + fix);
    };
    if (rows_per_microbatch % 16 != 0) {
      refuse("a microbatch's rows on a rank (samples x tokens)", rows_per_microbatch,
             "choose a seq_len or batch that makes it one");
    }
    for (const auto& [name, l] : layers) {
      for (int64_t n : {l->in_features, l->out_features}) {
        // A tensor-parallel rank holds 1/tp of one of the two: ask both to split into multiples of 16.
        const int64_t piece = n % tp_size == 0 ? n / tp_size : n;
        if (n % 16 != 0 || piece % 16 != 0) {
          refuse(name + "'s width " + std::to_string(n) + (tp_size > 1 ? " (over tp " + std::to_string(tp_size) + ")" : ""),
                 n % 16 != 0 ? n : piece, "leave it out of train.fp8.modules, or change the model's widths");
        }
      }
    }
  }
  return "fp8: " + std::to_string(layers.size()) + " Linear layers in float8 (" + name_of(f.recipe) +
         " scaling: e4m3 input and weight, e5m2 output gradient)";
}

}  // namespace composer

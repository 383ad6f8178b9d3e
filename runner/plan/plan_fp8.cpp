#include "runner/plan/plan_fp8.h"

#include <set>

#include "models/select.h"
#include "parallelisms/comm/collectives.h"
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

void mark_fp8_layers(nn::Module& model, const std::optional<Fp8Config>& f) {
  if (!f) return;
  for (auto& [name, layer] : fp8_layers(model, *f)) layer->fp8 = true;
}

void reduce_fp8_scales(nn::Module& model, const std::optional<Fp8Config>& f, parallel::Group* batch,
                       parallel::Group* sequence) {
  if (!f) return;
  std::vector<parallel::Group*> groups;
  for (parallel::Group* g : {batch, sequence}) {
    if (g && g->size > 1) groups.push_back(g);
  }
  if (groups.empty()) return;
  for (auto& [name, layer] : fp8_layers(model, *f)) {
    layer->fp8_amax = [sharded = layer->fp8_amax, groups](torch::Tensor& amax, nn::Fp8Operand which) {
      if (sharded) sharded(amax, which);
      // The weight is whole on every rank that splits the batch or the sequences.
      if (which == nn::Fp8Operand::kWeight) return;
      for (parallel::Group* g : groups) {
        if (!(amax.is_meta() && g->pg)) parallel::all_reduce(*g, amax, parallel::Reduce::kMax);  // as tp's
      }
    };
  }
}

std::string plan_fp8(const ExperimentConfig& c, nn::Module& model, int64_t rows_per_microbatch, int64_t tp_size,
                     int64_t dp_size, int64_t microbatches) {
  if (!c.train.fp8) return "";
  const Fp8Config& f = *c.train.fp8;
  const auto layers = fp8_layers(model, f);
  if (layers.empty()) {
    throw PlanError(f.modules_ref, "[" + YamlMap::join(f.modules) + "] selects no Linear layer of model " +
                                       c.model.name + "; name modules that hold Linear layers (e.g. 'layers.*')");
  }
  for (const auto& t : c.parallelize) {
    const auto* p = std::get_if<PipelineConfig>(&t.options);
    if (p && parallel::zero_bubble(p->schedule)) {
      throw PlanError(f.ref, std::string("float8 layers with the ") + parallel::name_of(p->schedule) + " schedule: its deferred weight "
                             "gradients would be computed in high precision; use 1f1b or interleaved_1f1b, or remove train.fp8");
    }
  }
  if (dp_size > 1 && microbatches > 1) {
    throw PlanError(f.ref, "float8 scales each operand by the largest magnitude in a microbatch; over " +
                               std::to_string(dp_size) + " data-parallel ranks with " + std::to_string(microbatches) +
                               " microbatches a rank's microbatch holds other samples than one device's, so the "
                               "plan would train a different model; use train.microbatches: 1 (and no pipeline), or "
                               "a plan without data parallelism");
  }
  if (c.mesh.device == DeviceKind::kCuda) {
    auto refuse = [&](const std::string& what, int64_t n, const std::string& fix) {
      throw PlanError(f.ref, "on cuda, float8 matmuls run through cuBLAS, which needs every matrix dimension "
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

// Giving a model built under nn::DeferInit (parameters on meta, their
// initialisations recorded) its values one parameter at a time, after the
// transforms have decided what this rank holds: each full tensor is drawn (or
// read from model.init_from or from_hf) exactly as a single-device build draws it, cut to
// this rank's piece and freed before the next, so a rank's setup peak is what
// it holds plus the largest single tensor, never the whole model.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "models/model.h"
#include "parallelisms/per_rank.h"
#include "parallelisms/placement.h"
#include "runner/checkpoint/weight_source.h"

namespace composer {

struct MaterialiseOptions {
  c10::ScalarType dtype = c10::kFloat;                // the training dtype each value is cast to
  const parallel::Placements* placements = nullptr;  // this rank's piece of each parameter (none: all of it)
  const WeightSource* init = nullptr;  // weights whose values replace the recorded initialisations
  // Parameters `init` does not hold, whose drawn values stay (train.lora's adapters).
  std::function<bool(const std::string&)> drawn;
  // Called with each parameter's name, its drawn full value and the value from
  // `init` that replaces it, on a rank that draws it whole (the main rank: all).
  std::function<void(const std::string&, const torch::Tensor& drawn, const torch::Tensor& given)> replaced;
  std::string write_init;  // where to write every full initial value (float32), or nothing
  // Where each parameter's piece goes (the values are always drawn on the CPU,
  // from the single-device generator stream); nullptr: the CPU. A piece going
  // to the CPU on a GPU run (offloaded shards) is put in pinned memory when
  // pin_host is set.
  std::function<c10::Device(const torch::Tensor&)> device_of;
  bool pin_host = false;
  // Per-rank parameters (parallel::apply_per_rank): each keeps its whole value,
  // not a piece of the stacked placement. With own_seed >= 0 that value is
  // this rank's draw under own_seed (a whole build under that seed), and
  // init.safetensors gets it.
  const parallel::ParamSet* own = nullptr;
  int64_t own_seed = -1;
};

// The recorded initialisations run in their recorded order on full-size
// float32 tensors, each kept only as this rank's piece: every parameter of
// `model` then has the values (and, cut to its placement, the shape) a
// single-device build converted to `dtype` and transformed would give it.
void materialise(models::Model& model, const std::vector<nn::DeferInit::Step>& steps, const MaterialiseOptions& options);

// Whether `steps` set every parameter of `model` (built under DeferInit) and
// no buffer was left on meta: a model that initialises a tensor some other way
// cannot be materialised, and is built whole instead.
bool fully_recorded(models::Model& model, const std::vector<nn::DeferInit::Step>& steps);

}  // namespace composer

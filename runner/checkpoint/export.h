// Consolidated weights: full tensors by PyTorch FQN in plain safetensors, for
// PyTorch and Hugging Face. The end of a run writes final.safetensors from the
// ranks' pieces one tensor at a time; `composer export` writes a checkpoint's
// weights (sharded with a model.safetensors.index.json when large) from its
// chunks, or a weights file's, in one process, as PyTorch names or as a
// Hugging Face folder through the model's adapter (models/hf_adapter.h).
#pragma once
#include <cstdint>
#include <string>

#include "models/model.h"
#include "parallelisms/placement.h"
#include "runner/config/config.h"

namespace composer {

// Writes every parameter of `model`, full, to `path` on rank 0 of `world`
// (a collective over it; null on one rank). Tensor by tensor, in order, the
// ranks that own a piece (one copy of each) send it to rank 0, which writes
// the tensor and drops it: rank 0 holds one full tensor at a time, the others
// one piece. `placements` is null without transforms.
void write_final_weights(models::Model& model, const parallel::Placements* placements, parallel::Group* world, int rank,
                         const std::string& path);

enum class ExportFormat {
  kPt,  // PyTorch names in one safetensors file (or shards beside it)
  kHf,  // a Hugging Face folder: config.json and model.safetensors (or shards and their index)
  kPeft,  // a PEFT LoRA adapter folder (train.lora): adapter_config.json and adapter_model.safetensors
};

struct ExportOptions {
  std::string checkpoint;                 // a step-N folder with index.json, or
  std::string weights;                    // a safetensors file in composer's names (a run's final.safetensors)
  std::string out;                        // pt: the file (shards go next to it); hf: the folder
  ExportFormat format = ExportFormat::kPt;
  uint64_t max_shard_bytes = 5000000000;  // larger exports are sharded (Hugging Face's default, 5GB)
  bool merge = false;  // pt, hf of a train.lora run: each adapted weight W + (alpha / rank) B A, no adapters
};

// "5GB", "500MB", "64KiB", "1000" (bytes) to bytes; a UserError for other text.
uint64_t parse_byte_size(const std::string& text, const std::string& option);

// Writes the parameters of checkpoint `o.checkpoint` (saved by config `c`,
// under any plan) or of weights file `o.weights`. pt: under every PyTorch
// name, tied weights under each of theirs; up to max_shard_bytes one file,
// o.out, above it <stem>-0000k-of-0000n.safetensors and
// <stem>.safetensors.index.json beside o.out (Hugging Face's layout). hf (a
// model with a Hugging Face adapter): folder o.out with the adapter's
// config.json and model.safetensors (or its shards), in its names and row
// order, a tied weight once, weights it stores one tensor per expert read as
// boxes of the stacked ones; arguments the adapter cannot write are refused.
// peft (a train.lora run of a model with a Hugging Face adapter): folder o.out
// with PEFT's adapter_config.json and adapter_model.safetensors, the adapters
// only, under the base's Hugging Face module names (lora_B's rows in the
// base weight's Hugging Face row order). A LoRA run exports as peft, or
// with merge as pt or hf: the base with every adapter added to its weight
// (W + (alpha / rank) B A in float32, as PEFT's merge_and_unload computes).
// Returns the lines it reports.
std::vector<std::string> export_weights(const ExperimentConfig& c, const ExportOptions& o);

}  // namespace composer

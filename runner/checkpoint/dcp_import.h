// checkpoint.resume_from_dcp: a PyTorch Distributed Checkpoint (DCP) folder,
// such as torchtitan's step-N, becomes a checkpoint of composer's, which then
// resumes under any plan as composer's own do (docs/checkpoints.md#pytorch-dcp).
//
// PyTorch reads it: tools/dcp_import.py loads each tensor whole with
// torch.distributed.checkpoint.load (whatever ranks and shards saved it) into
// safetensors parts beside a manifest of the rest. composer writes the parts as
// the rank files of dir's step-N with its hashes and index.json; torchtitan's
// train_state.step is that N. What composer does not take is said by name:
// the dataloader's state (composer's data goes on from sample N x
// global_batch in its own order), the LR scheduler's (composer's
// lr_schedule goes on at step N), the optimizer's param_groups (composer's
// train.optimizer applies) and any other entry. A tensor the model and
// optimizer do not have is the load's error, naming it.
#pragma once
#include <string>

#include "runner/config/config.h"

namespace composer {

// Imports checkpoint.resume_from_dcp into the checkpoint folder when it is
// set and that folder holds no complete checkpoint of composer's (a restart
// or a later run resumes composer's newest instead, and says so). Returns the
// step folder written, or "". Runs once, before the ranks start.
std::string import_dcp_if_needed(const ExperimentConfig& c, const std::string& out_dir);

}  // namespace composer

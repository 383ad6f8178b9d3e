#!/usr/bin/env bash
# Resharding: checkpoints saved under fully_shard over 4 ranks, of the
# uneven mlp_stack 17 (17-row weights in chunks of 5, 4, 4, 4) and of the
# tied-weight Transformer (and of the Llama under tp 2 x fully_shard 2 with Muon), load under other plans: tp 2 x fully_shard 2,
# pp 2 x fully_shard 2 (tied weights on both stages), HSDP 2 x 2 and one rank.
#  - Loading the last checkpoint (nothing left to train) and writing
#    final.safetensors from the new plan's pieces gives the saving run's
#    final.safetensors byte for byte: the loaded tensors are the saved ones.
#  - Resuming from step 4 and training on matches the single-device run
#    within the plan's golden tolerances (parameters and losses).
# Usage: checkpoint_reshard.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/checkpoint_common.sh"

reshard() {  # SAVER LAST_STEP SINGLE_DEVICE_CONFIG TARGET_CONFIGS...
  local saver=$1 last=$2 single=$3
  shift 3
  local s=$(basename "$saver" .yaml)
  run "$work/$s" "$saver" --set checkpoint.interval=2 --set checkpoint.keep_latest_k=3
  run "$work/single_$s" "$single" --set checkpoint.resume=never
  for target in "$@"; do
    local t=$(basename "$target" .yaml)
    run "$work/$s.$t.loaded" "$target" --set checkpoint.resume="$work/$s/checkpoints/step-00000$last"
    grep -q "training is complete" "$work/$s.$t.loaded.log" || fail "$t trained past the last checkpoint"
    cmp -s "$work/$s/final.safetensors" "$work/$s.$t.loaded/final.safetensors" ||
      fail "$t loaded other tensors than $s saved"
    run "$work/$s.$t" "$target" --set checkpoint.resume="$work/$s/checkpoints/step-000004"
    local diff
    diff=$(close_run "$work/single_$s" "$work/$s.$t" 5) || fail "$s -> $t: $diff"
    echo "ok: $s -> $t: loaded tensors equal the saved ones bit for bit; trained on from step 4 against one device: $diff"
  done
}

reshard configs/parity/fsdp_mlp_stack_17_dp4_keep.yaml 5 configs/parity/mlp_stack_17.yaml \
  configs/parity/fsdp2_tp2_mlp_stack_17_keep.yaml tests/cli/checkpoint_mlp_stack_17_hsdp.yaml \
  configs/parity/mlp_stack_17.yaml
# Muon's momentum buffers (and the AdamW group's moments) saved under tp 2 x fully_shard 2 resume
# under pp 2 x fully_shard 2 and on one rank.
reshard configs/parity/tp2_fsdp2_llama_muon.yaml 6 configs/parity/llama_muon.yaml \
  configs/parity/pp2_fsdp2_llama_muon.yaml configs/parity/llama_muon.yaml
reshard configs/parity/fsdp_transformer_dp4.yaml 6 configs/parity/transformer.yaml \
  configs/parity/fsdp2_tp2_transformer.yaml tests/cli/checkpoint_transformer_pp2_dp2.yaml \
  configs/parity/hsdp_transformer_2x2.yaml configs/parity/transformer.yaml

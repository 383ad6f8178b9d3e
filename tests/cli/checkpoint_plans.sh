#!/usr/bin/env bash
# Bit-exact resume under each kind of plan: a run saves steps 2 and 4 (and its
# last); a new process resumes from step 2 and must end with the same final
# parameters, byte for byte, and the same losses, bit for bit, as the run that
# went straight through. On one device, under replicate, tensor_parallel,
# pipeline and a 3-D plan (tp 2 x fully_shard 2 x pp 2).
# Usage: checkpoint_plans.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/checkpoint_common.sh"

for cfg in configs/parity/mlp_stack_17.yaml configs/parity/replicate_transformer_dp2.yaml \
  configs/parity/tp_mlp_stack_16_tp2.yaml configs/parity/pp2_1f1b_transformer.yaml \
  configs/parity/tp2_fsdp2_pp2_1f1b_mlp_module_layers.yaml; do
  name=$(basename "$cfg" .yaml)
  run "$work/$name" "$cfg" --set checkpoint.interval=2 --set checkpoint.keep_latest_k=3
  run "$work/$name.resumed" "$cfg" --set checkpoint.resume="$work/$name/checkpoints/step-000002"
  grep -q "resuming from $work/$name/checkpoints/step-000002" "$work/$name.resumed.log" || fail "$name did not resume"
  same_run "$work/$name" "$work/$name.resumed" 3
  echo "ok: $name resumed from step 2 ends bit for bit as the uninterrupted run"
done

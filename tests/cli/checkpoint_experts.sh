#!/usr/bin/env bash
# Checkpoints of a mixture-of-experts Llama under expert_parallel (the balanced
# model: its expert bias is a buffer that must travel too): a run under ep 4
# (one expert per rank) saves steps 2 and 4; a new process resumes from step 2
# under ep 4 and ends bit for bit as the uninterrupted run; the step-2
# checkpoint resumes under ep 2 x fully_shard 2, ep 2 x tensor_parallel 2 and
# under one device, each within its config's tolerances of the uninterrupted
# ep-4 run.
# Usage: checkpoint_experts.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/checkpoint_common.sh"

ep4=(--set 'mesh.shape=[4]' --set 'mesh.names=[ep]' --set 'parallelize=[{expert_parallel: {mesh_dim: ep}}]'
  --set train.steps=5)
cfg=configs/parity/ep2_moe_llama_balance.yaml
run "$work/ep4" "$cfg" "${ep4[@]}" --set checkpoint.interval=2 --set checkpoint.keep_latest_k=3
ck=$work/ep4/checkpoints/step-000002
[ -f "$ck/index.json" ] || fail "no complete step-2 checkpoint"
run "$work/ep4.resumed" "$cfg" "${ep4[@]}" --set checkpoint.resume="$ck"
grep -q "resuming from $ck" "$work/ep4.resumed.log" || fail "ep 4 did not resume"
same_run "$work/ep4" "$work/ep4.resumed" 3
echo "ok: ep 4 resumed from step 2 ends bit for bit as the uninterrupted run"

run "$work/ep2_fsdp2" configs/parity/ac_ep2_fsdp2_moe_llama_balance.yaml --set checkpoint.resume="$ck"
close_run "$work/ep4" "$work/ep2_fsdp2" 3
echo "ok: ep 2 x fully_shard 2 resumed from the ep-4 checkpoint, within its tolerances"
ep2tp2=(--set 'mesh.shape=[2,2]' --set 'mesh.names=[ep,tp]'
  --set 'parallelize=[{tensor_parallel: {mesh_dim: tp}}, {expert_parallel: {mesh_dim: ep}}]' --set train.steps=5)
run "$work/ep2_tp2" "$cfg" "${ep2tp2[@]}" --set checkpoint.resume="$ck" --set checkpoint.interval=2
grep -q "resuming from $ck" "$work/ep2_tp2.log" || fail "ep 2 x tp 2 did not resume"
close_run "$work/ep4" "$work/ep2_tp2" 3
echo "ok: ep 2 x tensor_parallel 2 resumed from the ep-4 checkpoint, within its tolerances"
# The resumed run under the new plan is its own uninterrupted run: its step-4
# checkpoint, resumed under the same plan, ends bit for bit as it did.
run "$work/ep2_tp2.again" "$cfg" "${ep2tp2[@]}" --set checkpoint.resume="$work/ep2_tp2/checkpoints/step-000004"
same_run "$work/ep2_tp2" "$work/ep2_tp2.again" 5
echo "ok: ep 2 x tensor_parallel 2 resumed again from its own step 4 ends bit for bit as its run"
run "$work/single" configs/parity/moe_llama_balance.yaml --set checkpoint.resume="$ck"
close_run "$work/ep4" "$work/single" 3
echo "ok: one device resumed from the ep-4 checkpoint, within its tolerances"

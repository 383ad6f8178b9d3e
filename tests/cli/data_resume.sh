#!/usr/bin/env bash
# Packed and blended data resume where they stopped. A sample is a pure
# function of (seed, step, global index): the checkpoint's step is the data
# position, whatever the plan or the background loader had read ahead.
#  - Under fully_shard dp 2, a run resumed from its step-2 checkpoint ends bit
#    for bit where the uninterrupted run ends (parameters and every loss).
#  - Under replicate dp 2 (another plan, whose two-rank average rounds as
#    fully_shard's does), resumed from the fully_shard run's step-2
#    checkpoint, it ends bit for bit where its own uninterrupted run ends.
#  - Under cp 2 x fully_shard dp 2, resumed from the same checkpoint, it
#    matches its own uninterrupted run within the plan's golden tolerances
#    (the plans sum in other orders, nothing else).
# Usage: data_resume.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/checkpoint_common.sh"
single=configs/parity/blend_docs_llama.yaml
dp2=$work/fsdp2_blend_docs_llama.yaml
sed -e 's/^name: blend_docs_llama/name: fsdp2_blend_docs_llama/' \
    -e 's/^train:/mesh: {shape: [2], names: [dp]}\nparallelize:\n  - fully_shard: {mesh_dim: dp, units: [layers.*]}\ntrain:/' \
    "$single" >"$dp2"
ddp2=$work/ddp2_blend_docs_llama.yaml
sed -e 's/^name: blend_docs_llama/name: ddp2_blend_docs_llama/' \
    -e 's/^train:/mesh: {shape: [2], names: [dp]}\nparallelize:\n  - replicate: {mesh_dim: dp}\ntrain:/' \
    "$single" >"$ddp2"
other=configs/parity/cp2_fsdp2_blend_docs_llama.yaml
every=(--set checkpoint.interval=2 --set checkpoint.keep_latest_k=3)

run "$work/dp2" "$dp2" "${every[@]}"
grep -q "data.sources: samples per source" "$work/dp2.log" || fail "the run did not log its samples per source"
run "$work/dp2_resumed" "$dp2" --set checkpoint.resume="$work/dp2/checkpoints/step-000002"
grep -q "resum" "$work/dp2_resumed.log" || fail "the resumed run did not resume"
same_run "$work/dp2" "$work/dp2_resumed" 3
echo "ok: fully_shard dp 2 resumed from step 2 ends bit for bit where the uninterrupted run ends"

run "$work/ddp2" "$ddp2" --set checkpoint.resume=never
run "$work/ddp2_resumed" "$ddp2" --set checkpoint.resume="$work/dp2/checkpoints/step-000002"
same_run "$work/ddp2" "$work/ddp2_resumed" 3
echo "ok: replicate dp 2 resumed from fully_shard dp 2's step 2 ends bit for bit where its uninterrupted run ends"

run "$work/other" "$other" --set checkpoint.resume=never
run "$work/other_resumed" "$other" --set checkpoint.resume="$work/dp2/checkpoints/step-000002"
diff=$(close_run "$work/other" "$work/other_resumed" 3) || fail "cp 2 x fully_shard resumed from dp 2: $diff"
echo "ok: cp 2 x fully_shard dp 2 resumed from the dp 2 run's step 2: $diff"

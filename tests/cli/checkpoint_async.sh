#!/usr/bin/env bash
# Asynchronous checkpoints (checkpoint.async: true) under the plan CONFIG:
#  1. every checkpoint folder an async run keeps equals, file for file and
#     byte for byte, the one a synchronous run of the same config keeps
#     (rank files and index.json), and the final parameters are the same;
#  2. a rank killed (SIGKILL) by its writer thread after writing its file of
#     step 4 and before the index leaves step 2's checkpoint complete: the run
#     resumes from it and ends bit for bit where an uninterrupted run ends.
# Usage: checkpoint_async.sh COMPOSER CONFIG WORK_DIR
set -u
composer=$1 cfg=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/checkpoint_common.sh"
sets=(--set checkpoint.interval=2 --set train.steps=6 --set checkpoint.keep_latest_k=3)

run "$work/sync" "$cfg" "${sets[@]}" --set checkpoint.resume=never
run "$work/async" "$cfg" "${sets[@]}" --set checkpoint.resume=never --set checkpoint.async=true
grep -q "written in the background (checkpoint.async)" "$work/async.log" || fail "the async run logged no background save"
kept=$(cd "$work/async/checkpoints" && ls -d step-* | tr '\n' ' ')
[ "$kept" = "step-000002 step-000004 step-000006 " ] || fail "the async run kept $kept"
diff -r "$work/sync/checkpoints" "$work/async/checkpoints" >"$work/diff.txt" ||
  fail "async checkpoints differ from sync ones: $(head -3 "$work/diff.txt")"
cmp -s "$work/sync/final.safetensors" "$work/async/final.safetensors" || fail "final parameters differ"
files=$(find "$work/async/checkpoints" -type f | wc -l)
echo "ok: async saves of steps 2, 4, 6 equal the sync saves byte for byte ($files files)"

"$composer" run --config "$cfg" --out "$work/killed" "${sets[@]}" --set checkpoint.async=true \
  --set debug.fail_rank=1 --set debug.fail_step=4 --set debug.fail_at=before_index --set debug.fail_mode=signal \
  >"$work/killed1.log" 2>&1 && fail "the rank killed during the async save of step 4 did not fail the run"
grep -q "rank 1 was killed by signal 9" "$work/killed1.log" || fail "rank 1's kill is not named: $(tail -2 "$work/killed1.log")"
[ -f "$work/killed/checkpoints/step-000002/index.json" ] || fail "step 2's checkpoint is not complete"
[ -f "$work/killed/checkpoints/step-000004/index.json" ] && fail "step 4 has an index although rank 1 died before it"
run "$work/killed" "$cfg" "${sets[@]}" --set checkpoint.async=true
grep -q "resuming from $work/killed/checkpoints/step-000002 (step 2 of 6)" "$work/killed.log" ||
  fail "did not resume from step 2: $(grep -m1 resum "$work/killed.log")"
same_run "$work/sync" "$work/killed" 1
echo "ok: a rank killed in its async write of step 4: resumed from step 2, final parameters bit for bit"

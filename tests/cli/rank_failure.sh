#!/usr/bin/env bash
# A rank that fails mid-run stops the whole job within seconds: exit 3, one
# message naming the rank, no hang, no orphan process.
# Usage: rank_failure.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
start=$(date +%s)
timeout 60 "$composer" run --config configs/parity/replicate_transformer_dp4.yaml --out "$work/run" \
  --set debug.fail_rank=2 --set debug.fail_step=3 --set train.steps=50 >"$work/out.log" 2>"$work/err.log"
code=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/err.log"
[ $code -eq 3 ] || { echo "FAIL: exit code $code, expected 3"; exit 1; }
grep -q "\[rank 2/4\] runtime failure: injected failure at step 3" "$work/err.log" || { echo "FAIL: no rank-2 message"; exit 1; }
grep -q "^rank 2 failed with exit code 3; stopped the other ranks" "$work/err.log" || { echo "FAIL: no summary"; exit 1; }
[ $elapsed -le 30 ] || { echo "FAIL: took ${elapsed}s to stop"; exit 1; }
sleep 1
if pgrep -f -- "$work/run" >/dev/null; then echo "FAIL: orphan processes:"; pgrep -af -- "$work/run"; exit 1; fi
echo "ok: job stopped in ${elapsed}s with exit 3 and no orphans"

#!/usr/bin/env bash
# Per-rank parameters in checkpoints: the mixture of experts trained under
# fully_shard saves every rank's expert; resumed at step 3 under replicate it
# must end bit for bit where the uninterrupted fully_shard run ends.
# Usage: per_rank_checkpoint.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
"$composer" run --config configs/parity/fsdp_mixture_of_experts_dp2.yaml --out "$work/a" --set checkpoint.interval=3 \
  --set checkpoint.resume=never >"$work/a.log" 2>&1 || fail "fully_shard run: $(tail -3 "$work/a.log")"
"$composer" run --config configs/parity/replicate_mixture_of_experts_dp2.yaml --out "$work/b" \
  --set "checkpoint.resume=$work/a/checkpoints/step-000003" --set "checkpoint.dir=$work/b/checkpoints" \
  >"$work/b.log" 2>&1 || fail "replicate run resumed at step 3: $(tail -3 "$work/b.log")"
grep -q "resuming from $work/a/checkpoints/step-000003" "$work/b.log" || fail "the replicate run did not resume"
cmp -s "$work/a/final.safetensors" "$work/b/final.safetensors" ||
  fail "resumed under replicate, the final parameters differ from the fully_shard run's"
echo "ok: every rank's expert and the shared parameters resume from a fully_shard checkpoint under replicate, bit for bit"

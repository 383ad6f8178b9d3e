#!/usr/bin/env bash
# A finished run continued with a larger train.steps (and nothing else
# changed) resumes from its last checkpoint and trains on: with a constant
# learning rate it ends bit for bit where a run started with the larger total
# ends (optimizer state, data position and RNG carry on). Any other change to
# the train section is still refused.
# Usage: train_longer.sh COMPOSER CONFIG WORK_DIR
set -u
composer=$1 cfg=$2 work=$3
rm -rf "$work"
status=0
fail() { echo "FAIL: $*"; status=1; }
"$composer" run --config "$cfg" --out "$work/grown" --set train.steps=3 >/dev/null 2>&1 || fail "the 3-step run failed"
out=$("$composer" run --config "$cfg" --out "$work/grown" --set train.steps=5 2>&1) || fail "the continued run failed: $(echo "$out" | tail -2)"
echo "$out" | grep -q "resuming step 3 of a run saved with train.steps 3; training on to 5 steps" ||
  fail "no log line saying the run continues: $(echo "$out" | grep -i resum | head -2)"
"$composer" run --config "$cfg" --out "$work/fresh" --set train.steps=5 >/dev/null 2>&1 || fail "the 5-step run failed"
cmp -s "$work/grown/final.safetensors" "$work/fresh/final.safetensors" ||
  fail "3 steps then 2 more end elsewhere than 5 steps"
[ "$status" -eq 0 ] && echo "ok: 3 steps continued to 5 equal 5 steps, bit for bit"
out=$("$composer" run --config "$cfg" --out "$work/grown" --set train.steps=6 --set train.optimizer.lr=0.5 2>&1); code=$?
[ "$code" -eq 2 ] && echo "$out" | grep -q "was saved by a config with another seed, model, train or data section" ||
  fail "another learning rate was not refused (exit $code): $(echo "$out" | tail -1)"
[ "$status" -eq 0 ] && echo "ok: another learning rate is still refused"
exit $status

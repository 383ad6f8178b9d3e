#!/usr/bin/env bash
# Stragglers: every rank's step, compute and communication time is logged
# each step (metrics.jsonl); a rank slowed on purpose (debug.delay after the
# loss, on rank 2 of 4) is named a straggler, and no rank is named in the same
# run without the delay.
# Usage: stragglers.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
cfg=configs/parity/fsdp_mlp_stack_16_dp4.yaml
sets=(--set checkpoint.resume=never --set train.steps=10 --set metrics.straggler_steps=4 --set metrics.straggler_factor=2)

"$composer" run --config "$cfg" --out "$work/plain" "${sets[@]}" >"$work/plain.log" 2>&1 ||
  fail "plain run: $(tail -3 "$work/plain.log")"
grep -q "straggler:" "$work/plain.log" && fail "a rank was named a straggler without a delay: $(grep straggler: "$work/plain.log")"
/usr/bin/python3 - "$work/plain/metrics.jsonl" <<'PY' || fail "metrics.jsonl lacks the per-rank times"
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    for k in ("rank_step_ms", "rank_compute_ms", "rank_comm_wait_ms"):
        assert len(j[k]) == 4, (k, j.get(k))
    assert j["stragglers"] == [], j["stragglers"]
    for s, c, w in zip(j["rank_step_ms"], j["rank_compute_ms"], j["rank_comm_wait_ms"]):
        assert abs(s - c - w) < 1e-6 and c >= 0 and w >= 0, (s, c, w)
PY
"$composer" run --config "$cfg" --out "$work/slow" "${sets[@]}" \
  --set 'debug.delay=[{point: after_loss, ms: 150, ranks: [2]}]' >"$work/slow.log" 2>&1 ||
  fail "delayed run: $(tail -3 "$work/slow.log")"
line=$(grep -m1 "straggler: rank 2 is" "$work/slow.log") || fail "rank 2 is not named a straggler"
named=$(grep -o "straggler: rank [0-9]* is [0-9]" "$work/slow.log" | grep -o "rank [0-9]*" | sort -u | tr '\n' ' ')
[ "$named" = "rank 2 " ] || fail "named: $named, expected rank 2 only"
/usr/bin/python3 - "$work/slow/metrics.jsonl" <<'PY' || fail "the last step's record does not list rank 2"
import json, sys
last = [json.loads(l) for l in open(sys.argv[1])][-1]
assert last["stragglers"] == [2], last["stragglers"]
PY
echo "ok: no straggler without a delay; with 150 ms on rank 2: ${line#*straggler: }"

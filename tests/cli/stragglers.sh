#!/usr/bin/env bash
# Stragglers: every rank's step, compute and communication time is logged
# each step (metrics.jsonl); a rank slowed on purpose (debug.delay after the
# loss, on rank 2 of 4) is named a straggler, and no rank is named in the same
# run without the delay. Of two ranks, one slowed to about half speed from
# outside (stopped and continued every 10 ms) is named at the default
# straggler_factor 1.5, and the other is not.
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

# Two ranks with ~50 ms of compute a step; rank 1 throttled from its first step to its exit.
"$composer" run --config configs/parity/fsdp_mlp_stack_16_dp2.yaml --out "$work/throttled" --set checkpoint.resume=never \
  --set train.steps=40 --set model.args.mlp_dim=256 --set train.global_batch=512 >"$work/throttled.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  [ -s "$work/throttled/metrics.jsonl" ] && break
  sleep 0.1
done
rank1=$(pgrep -P "$launcher" | sort -n | sed -n 2p)
[ -n "$rank1" ] || { kill -9 "$launcher"; fail "throttled run: no rank 1 process"; }
/usr/bin/python3 - "$rank1" <<'PY'
import os, signal, sys, time
pid = int(sys.argv[1])
try:
    while True:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.01)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
except ProcessLookupError:
    pass
PY
wait "$launcher" || fail "throttled run: $(tail -3 "$work/throttled.log")"
named=$(grep -o "straggler: rank [0-9]* is [0-9]" "$work/throttled.log" | grep -o "rank [0-9]*" | sort -u | tr '\n' ' ')
[ "$named" = "rank 1 " ] || fail "rank 1 at half speed: named '$named', expected rank 1 only: $(grep -m2 straggler: "$work/throttled.log")"
line=$(grep -m1 "straggler: rank 1 is" "$work/throttled.log")
echo "ok: rank 1 of 2 at half speed (stopped and continued every 10 ms): ${line#*straggler: }"

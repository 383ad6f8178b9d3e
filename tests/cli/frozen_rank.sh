#!/usr/bin/env bash
# A rank that freezes (SIGSTOP mid-run, as a hung driver would leave it) makes
# the job fail within mesh.timeout_s (10 s here) plus the launcher's grace,
# exit 3, naming the frozen rank rather than a peer that timed out waiting for
# it, with no process left behind. Under fully_shard and under a pipeline.
# Usage: frozen_rank.sh COMPOSER CONFIG WORK_DIR
set -u
composer=$1 cfg=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
"$composer" run --config "$cfg" --out "$work/run" --set train.steps=100000 --set mesh.timeout_s=10 \
  --set 'debug.delay=[{point: after_loss, ms: 20}]' --set checkpoint.resume=never >"$work/out.log" 2>"$work/err.log" &
launcher=$!
for _ in $(seq 600); do
  [ -f "$work/run/metrics.jsonl" ] && [ "$(wc -l <"$work/run/metrics.jsonl")" -ge 2 ] && break
  sleep 0.1
done
rank1=$(pgrep -P "$launcher" | sort -n | sed -n 2p)
[ -n "$rank1" ] || { echo "FAIL: no rank 1 process"; kill -9 "$launcher"; exit 1; }
start=$(date +%s)
kill -STOP "$rank1"
wait "$launcher"; code=$?
elapsed=$(( $(date +%s) - start ))
status=0
[ "$code" -eq 3 ] || { echo "FAIL: exit $code, expected 3"; status=1; }
grep -q "^rank 1 was stopped by signal 19 (SIGSTOP) and never resumed; its peers timed out waiting for it" "$work/err.log" ||
  { echo "FAIL: the frozen rank is not named: $(tail -2 "$work/err.log")"; status=1; }
[ "$elapsed" -le 40 ] || { echo "FAIL: took ${elapsed}s to fail"; status=1; }
kill -0 "$rank1" 2>/dev/null && { echo "FAIL: the frozen rank is still there"; kill -9 "$rank1"; status=1; }
pgrep -f -- "--out $work/run" >/dev/null && { echo "FAIL: a rank is left behind"; status=1; }
[ "$status" -eq 0 ] && echo "ok: SIGSTOP of rank 1: exit 3 naming rank 1 in ${elapsed}s, nothing left behind"
exit $status

#!/usr/bin/env bash
# A rank stopped and continued over and over until it exits (SIGSTOP then
# SIGCONT: Ctrl-Z then fg, cpulimit-style throttling, a scheduler suspending
# and resuming it). The launcher sees it stopped at most of its polls, and
# often learns of its exit before it learns of the last continue; a rank
# that exited 0 ran to its end all the same. Each of 3 trials: the job ends
# 0, names no rank, and under launch.max_restarts 1 is not restarted.
# Usage: stop_continue.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
cfg=configs/parity/fsdp_transformer_dp2.yaml
for trial in 1 2 3; do
  out=$work/run$trial
  "$composer" run --config "$cfg" --out "$out" --set checkpoint.resume=never --set train.steps=6 \
    --set launch.max_restarts=1 --set launch.restart_wait_s=0 >"$out.log" 2>&1 &
  launcher=$!
  for _ in $(seq 600); do  # until the first step is logged: the rest of the run is throttled
    [ -s "$out/metrics.jsonl" ] && break
    sleep 0.1
  done
  rank1=$(pgrep -P "$launcher" | sort -n | sed -n 2p)
  [ -n "$rank1" ] || { kill -9 "$launcher"; fail "trial $trial: no rank 1 process"; }
  # Stopped 150 ms (longer than the launcher's poll), running 20 ms, until it is gone.
  while kill -STOP "$rank1" 2>/dev/null; do
    sleep 0.15
    kill -CONT "$rank1" 2>/dev/null
    sleep 0.02
  done
  wait "$launcher"
  code=$?
  [ "$code" -eq 0 ] || fail "trial $trial: exit $code, expected 0: $(grep -v '^\[rank' "$out.log" | tail -2)"
  grep -q "was stopped by signal" "$out.log" && fail "trial $trial: a rank that exited 0 was named frozen"
  grep -q "restarting the job" "$out.log" && fail "trial $trial: a finished job was restarted"
  [ -f "$out/final.safetensors" ] || fail "trial $trial: no final parameters"
done
echo "ok: rank 1 stopped and continued until its exit, 3 trials: exit 0, no rank named, no restart"

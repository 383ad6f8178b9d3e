#!/usr/bin/env bash
# Preemption: SIGTERM to the launcher (as SLURM or Kubernetes send before a
# kill) lets every rank finish its step, saves a checkpoint and exits 4; the
# same command run again resumes and ends bit for bit where an uninterrupted
# run ends. A second signal more than a second later stops the job at once.
# Usage: preempt.sh COMPOSER CONFIG WORK_DIR
set -u
composer=$1 cfg=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
status=0
fail() { echo "FAIL: $*"; status=1; }
slow=(--set train.steps=30 --set 'debug.delay=[{point: before_optimizer_step, ms: 60}]')  # once a step, whatever the microbatches
wait_for_steps() {  # until metrics.jsonl of $1 has $2 lines (at most 60 s)
  for _ in $(seq 600); do
    [ -f "$1/metrics.jsonl" ] && [ "$(wc -l <"$1/metrics.jsonl")" -ge "$2" ] && return 0
    sleep 0.1
  done
  return 1
}
"$composer" run --config "$cfg" --out "$work/run" "${slow[@]}" >"$work/first.log" 2>&1 &
pid=$!
wait_for_steps "$work/run" 3 || fail "the run did not reach step 3"
kill -TERM "$pid"
wait "$pid"; code=$?
[ "$code" -eq 4 ] || fail "exit $code after SIGTERM, expected 4: $(tail -2 "$work/first.log")"
grep -q "stopped on request: every rank finished its step" "$work/first.log" || fail "no stop message"
saved=$(ls -d "$work/run/checkpoints/"step-* 2>/dev/null | tail -1)
[ -n "$saved" ] && [ -f "$saved/index.json" ] || fail "no complete checkpoint after the stop"
[ "$status" -eq 0 ] && echo "ok: SIGTERM: exit 4 after $(basename "$saved"), checkpoint complete"
"$composer" run --config "$cfg" --out "$work/run" "${slow[@]}" >"$work/second.log" 2>&1 ||
  fail "the run again failed: $(tail -2 "$work/second.log")"
grep -q "resuming from .*$(basename "$saved")" "$work/second.log" || fail "the run again did not resume from $saved"
"$composer" run --config "$cfg" --out "$work/whole" "${slow[@]}" >/dev/null 2>&1 || fail "the uninterrupted run failed"
cmp -s "$work/run/final.safetensors" "$work/whole/final.safetensors" ||
  fail "stopped and resumed, the run ends elsewhere than the uninterrupted one"
[ "$status" -eq 0 ] && echo "ok: run again, it resumes and ends bit for bit like the uninterrupted run"
"$composer" run --config "$cfg" --out "$work/twice" --set train.steps=30 \
  --set 'debug.delay=[{point: before_optimizer_step, ms: 4000}]' >"$work/twice.log" 2>&1 &
pid=$!
wait_for_steps "$work/twice" 1 || fail "the slow run did not reach step 1"
start=$(date +%s%N)
kill -TERM "$pid"; sleep 1.5; kill -TERM "$pid"
wait "$pid"; code=$?
took=$(( ($(date +%s%N) - start) / 1000000 ))
[ "$code" -eq 130 ] || fail "exit $code after two signals, expected 130 (interrupted)"
[ "$took" -lt 3500 ] || fail "the second signal took ${took} ms to stop the job"
pgrep -f -- "--out $work/twice" >/dev/null && fail "a rank of the twice-signalled job is still running"
[ "$status" -eq 0 ] && echo "ok: a second SIGTERM 1.5 s later stopped the job in ${took} ms (exit 130)"
exit $status

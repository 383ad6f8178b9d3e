#!/usr/bin/env bash
# The rank that really died is named as the cause: rank 1 of a 2-rank
# replicate job is killed with `kill -9` from outside mid-run (its peer's lost
# connection is usually reported first), then made to die by an injected
# SIGKILL, and to exit non-zero without reporting. Each time: exit 3 within
# 30 s, a summary naming rank 1 and how it died, no process left behind. A
# Ctrl-C to the whole job is a request to stop (exit 4 after the step in flight
# and its checkpoint), not a cause.
# Usage: rank_killed.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; cat "$work/err.log"; exit 1; }

check_stopped() {  # $1: elapsed seconds, $2: out dir
  [ "$1" -le 30 ] || fail "took ${1}s to stop"
  sleep 1
  if pgrep -f -- "$2" >/dev/null; then pgrep -af -- "$2"; fail "orphan processes"; fi
}

# Starts the quickstart with a step count it never reaches ($1: the out dir,
# $2: a command prefix such as setsid) and waits until rank 0 logged step 3;
# sets $launcher.
start_long_job() {
  ${2:-} "$composer" run --config configs/quickstart.yaml --out "$1" --set train.steps=100000 \
    --set train.log_every=1 >"$work/out.log" 2>"$work/err.log" &
  launcher=$!
  for _ in $(seq 600); do grep -q "step 3" "$work/out.log" 2>/dev/null && return; sleep 0.1; done
  kill -9 "$launcher"
  fail "the job never reached step 3"
}

# Waits for $launcher; sets $code and $elapsed (seconds since $1).
finish() {
  wait "$launcher"
  code=$?
  elapsed=$(( $(date +%s) - $1 ))
}

# 1. kill -9 from outside, once the job has trained a few steps.
out="$work/killed"
start_long_job "$out"
victim=""
for pid in $(pgrep -P "$launcher"); do
  if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "composer r1" ]; then victim=$pid; fi
done
[ -n "$victim" ] || { kill -9 "$launcher"; fail "found no rank 1 process"; }
kill -9 "$victim"
finish "$(date +%s)"
[ $code -eq 3 ] || fail "exit code $code after kill -9 of rank 1, expected 3"
grep -q "^rank 1 was killed by signal 9 (SIGKILL); stopped the other ranks" "$work/err.log" || fail "kill -9: no summary naming rank 1"
check_stopped "$elapsed" "$out"
echo "ok: kill -9 of rank 1 named, stopped in ${elapsed}s"

# 2. and 3. injected: SIGKILL, and a silent non-zero exit.
for mode in signal exit; do
  out="$work/$mode"
  start=$(date +%s)
  timeout 60 "$composer" run --config configs/quickstart.yaml --out "$out" --set debug.fail_rank=1 \
    --set debug.fail_step=2 --set debug.fail_mode=$mode >"$work/out.log" 2>"$work/err.log"
  code=$?
  elapsed=$(( $(date +%s) - start ))
  [ $code -eq 3 ] || fail "$mode: exit code $code, expected 3"
  if [ $mode = signal ]; then want="^rank 1 was killed by signal 9 \(SIGKILL\); stopped the other ranks"
  else want="^rank 1 exited with code 7 without reporting an error; stopped the other ranks"; fi
  grep -Eq "$want" "$work/err.log" || fail "$mode: no summary /$want/"
  check_stopped "$elapsed" "$out"
  echo "ok: $mode of rank 1 named, stopped in ${elapsed}s"
done

# 4. Ctrl-C reaches the launcher and every rank (one process group): that is
#    one request to stop (exit 4 once the step and its checkpoint are done), not
#    a rank killed by SIGINT.
out="$work/interrupted"
start_long_job "$out" setsid
kill -INT -- "-$launcher"
finish "$(date +%s)"
[ $code -eq 4 ] || fail "Ctrl-C: exit code $code, expected 4"
grep -q "^stopped on request: every rank finished its step" "$work/err.log" || fail "Ctrl-C: not reported as a stop on request"
check_stopped "$elapsed" "$out"
echo "ok: Ctrl-C to the whole job stops it after its step, in ${elapsed}s"

#!/usr/bin/env bash
# Automatic restarts (launch.max_restarts) under the plan CONFIG:
#  1. rank 1 is killed (SIGKILL) at step 3 on the first two attempts; with
#     max_restarts 2 the launcher restarts the job twice, each time from the
#     step-2 checkpoint, and the job ends bit for bit where an uninterrupted
#     run ends (final parameters and every logged loss);
#  2. killed on three attempts with max_restarts 2, it gives up: exit 3;
#  3. a failure a restart cannot cure is not restarted: bad input (exit 2)
#     and a diverged run (a NaN gradient under on_nonfinite: stop, exit 5);
#  4. under checkpoint.resume: never the restart line says the ranks start
#     again from step 1, and they do (no resume; the losses of step 1 on are
#     the uninterrupted run's).
# Usage: restarts.sh COMPOSER CONFIG WORK_DIR
set -u
composer=$1 cfg=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
. "$(dirname "$0")/checkpoint_common.sh"
sets=(--set checkpoint.interval=2 --set train.steps=4 --set launch.restart_wait_s=0.2)
kill_rank1=(--set debug.fail_rank=1 --set debug.fail_step=3 --set debug.fail_mode=signal)

run "$work/straight" "$cfg" "${sets[@]}" --set checkpoint.resume=never
start=$SECONDS
"$composer" run --config "$cfg" --out "$work/restarted" "${sets[@]}" --set launch.max_restarts=2 "${kill_rank1[@]}" \
  --set debug.fail_attempts=2 >"$work/restarted.log" 2>&1 || fail "restarted job failed: $(tail -3 "$work/restarted.log")"
took=$((SECONDS - start))
kills=$(grep -c "^rank 1 was killed by signal 9 (SIGKILL)" "$work/restarted.log")
[ "$kills" -eq 2 ] || fail "expected rank 1 killed twice, the log names $kills kills"
grep -q "restarting the job (restart 1 of 2)" "$work/restarted.log" || fail "no first restart logged"
grep -q "restarting the job (restart 2 of 2)" "$work/restarted.log" || fail "no second restart logged"
grep -q "restarting the job (restart 1 of 2) in 0.2 s; its ranks resume from the newest complete checkpoint" \
  "$work/restarted.log" || fail "the restart line does not say the ranks resume: $(grep 'restarting' "$work/restarted.log")"
resumes=$(grep -c "resuming from $work/restarted/checkpoints/step-000002 (step 2 of 4)" "$work/restarted.log")
[ "$resumes" -eq 2 ] || fail "expected 2 resumes from step 2, found $resumes"
same_run "$work/straight" "$work/restarted" 1
echo "ok: rank 1 killed on 2 attempts, restarted twice from step 2, final parameters and losses bit for bit (${took} s)"

"$composer" run --config "$cfg" --out "$work/gives_up" "${sets[@]}" --set launch.max_restarts=2 "${kill_rank1[@]}" \
  --set debug.fail_attempts=3 >"$work/gives_up.log" 2>&1
code=$?
[ "$code" -eq 3 ] || fail "three failures with max_restarts 2: exit $code, expected 3"
grep -q "the job failed on all 3 attempts; giving up" "$work/gives_up.log" || fail "no giving-up line"
echo "ok: killed on 3 attempts with max_restarts 2: gave up after 3 attempts, exit 3"

"$composer" run --config "$cfg" --out "$work/nan" "${sets[@]}" --set launch.max_restarts=2 \
  --set debug.inject=nan_grad --set debug.inject_step=3 --set debug.inject_rank=1 >"$work/nan.log" 2>&1
code=$?
[ "$code" -eq 5 ] || fail "a NaN gradient under on_nonfinite stop: exit $code, expected 5"
grep -q "restarting the job" "$work/nan.log" && fail "a diverged run was restarted"
"$composer" run --config "$cfg" --out "$work/bad" "${sets[@]}" --set launch.max_restarts=2 \
  --set checkpoint.resume=/nonexistent >"$work/bad.log" 2>&1
code=$?
[ "$code" -eq 2 ] || fail "bad input: exit $code, expected 2"
grep -q "restarting the job" "$work/bad.log" && fail "bad input was restarted"
echo "ok: a diverged run (exit 5) and bad input (exit 2) are not restarted"

"$composer" run --config "$cfg" --out "$work/never" "${sets[@]}" --set launch.max_restarts=1 "${kill_rank1[@]}" \
  --set checkpoint.resume=never >"$work/never.log" 2>&1 || fail "restarted job under resume never failed: $(tail -3 "$work/never.log")"
line=$(grep "launch.max_restarts: restarting the job" "$work/never.log") || fail "no restart logged under resume never"
[[ "$line" == *"its ranks start again from step 1 (checkpoint.resume: never)" ]] ||
  fail "the restart line under resume never: $line"
grep -q "resuming from" "$work/never.log" && fail "a restart under resume never resumed: $(grep -m1 'resuming from' "$work/never.log")"
same_run "$work/straight" "$work/never" 1
echo "ok: under checkpoint.resume never the restart line says step 1, and the restarted job trains from step 1"

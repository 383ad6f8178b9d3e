#!/usr/bin/env bash
# A checkpoint save that runs out of space (a file-size limit, RLIMIT_FSIZE,
# below a rank file's size) fails with exit 3 naming the file and the bytes it
# needed; the previous checkpoint stays complete, the failed step's folder has
# no index.json, and the same command without the limit resumes from the
# previous checkpoint and ends bit for bit where an uninterrupted run ends.
# Usage: disk_full.sh COMPOSER CONFIG WORK_DIR
set -u
composer=$1 cfg=$2 work=$3
rm -rf "$work"
status=0
fail() { echo "FAIL: $*"; status=1; }
"$composer" run --config "$cfg" --out "$work/run" --set train.steps=2 --set checkpoint.interval=1 >/dev/null 2>&1 ||
  fail "the 2-step run failed"
limit_kib=$(( $(stat -c %s "$work/run/checkpoints/step-000002/rank-00000.safetensors") / 1024 - 2 ))
out=$(ulimit -f "$limit_kib"; "$composer" run --config "$cfg" --out "$work/run" --set train.steps=4 \
      --set checkpoint.interval=1 2>&1); code=$?
[ "$code" -eq 3 ] || fail "exit $code under a $limit_kib KiB file-size limit, expected 3"
echo "$out" | grep -Eq 'cannot write [^ ]*step-000003/rank-0000[0-9].safetensors: File too large after [0-9]+ of the [0-9]+ bytes it needs' ||
  fail "no message naming the file and the bytes: $(echo "$out" | grep -v '^\[rank' | tail -2)"
[ -f "$work/run/checkpoints/step-000002/index.json" ] || fail "the step-2 checkpoint lost its index"
[ ! -e "$work/run/checkpoints/step-000003/index.json" ] || fail "the failed step-3 folder has an index.json"
ls "$work/run/checkpoints/step-000003/"*.tmp >/dev/null 2>&1 && fail "a partial .tmp file was left behind"
[ "$status" -eq 0 ] && echo "ok: under a $limit_kib KiB limit the step-3 save fails with exit 3 naming the file; step 2 intact"
out=$("$composer" run --config "$cfg" --out "$work/run" --set train.steps=4 --set checkpoint.interval=1 2>&1) ||
  fail "the run without the limit failed: $(echo "$out" | tail -2)"
echo "$out" | grep -q "resuming from .*step-000002" || fail "it did not resume from step 2: $(echo "$out" | grep -i resum)"
"$composer" run --config "$cfg" --out "$work/fresh" --set train.steps=4 >/dev/null 2>&1 || fail "the 4-step run failed"
cmp -s "$work/run/final.safetensors" "$work/fresh/final.safetensors" || fail "the resumed run ends elsewhere"
[ "$status" -eq 0 ] && echo "ok: run again without the limit, it resumes from step 2 and ends bit for bit like 4 steps"
exit $status

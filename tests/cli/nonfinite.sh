#!/usr/bin/env bash
# A gradient that turns NaN (debug.inject: nan_grad, from step 3 on, on one
# rank of a fully_shard plan) under train.on_nonfinite:
#   stop (the default): exit 5 before step 3's update, naming the step, the rank
#     and the parameter; the step-1 and step-2 checkpoints stay, nothing later is
#     written (no step-3 checkpoint, no final weights);
#   skip: step 3's update is left out, so weights and optimizer state are bit
#     for bit those of a run that stopped after step 2, and metrics mark it;
#     with max_skipped 2, the third poisoned step in a row stops the job.
# Usage: nonfinite.sh COMPOSER CONFIG WORK_DIR
set -u
composer=$1 cfg=$2 work=$3
python=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
rm -rf "$work"
status=0
fail() { echo "FAIL: $*"; status=1; }
poison=(--set debug.inject=nan_grad --set debug.inject_step=3 --set debug.inject_rank=1 --set checkpoint.interval=1
        --set checkpoint.resume=never)

out=$("$composer" run --config "$cfg" --out "$work/stop" "${poison[@]}" --set train.steps=4 2>&1); code=$?
[ "$code" -eq 5 ] || fail "stop: exit $code, expected 5"
echo "$out" | grep -Eq 'step 3: the gradient of [a-z_.0-9]+ on rank 1 is not finite' ||
  fail "stop: no message naming step 3, rank 1 and the parameter: $(echo "$out" | tail -2)"
[ -d "$work/stop/checkpoints/step-000002" ] || fail "stop: the step-2 checkpoint is missing"
[ ! -e "$work/stop/checkpoints/step-000003" ] || fail "stop: a step-3 checkpoint was written"
[ ! -e "$work/stop/final.safetensors" ] || fail "stop: final weights were written"
[ "$status" -eq 0 ] && echo "ok: stop: exit 5 at step 3 naming rank 1; checkpoints 1-2 kept, nothing after"

"$composer" run --config "$cfg" --out "$work/two" --set train.steps=2 --set checkpoint.interval=1 \
  --set checkpoint.resume=never >/dev/null 2>&1 || fail "the 2-step run failed"
"$composer" run --config "$cfg" --out "$work/skip" "${poison[@]}" --set train.steps=3 \
  --set train.on_nonfinite=skip >"$work/skip.log" 2>&1 || fail "skip: the run failed: $(tail -2 "$work/skip.log")"
cmp -s "$work/two/final.safetensors" "$work/skip/final.safetensors" ||
  fail "skip: final weights differ from the run that stopped after step 2"
grep -q '"skipped":true' "$work/skip/metrics.jsonl" || fail "skip: metrics.jsonl does not mark the skipped step"
# Every tensor of each rank's checkpoint (weights and optimizer state), not the RNG state, bit for bit.
"$python" - "$work/two/checkpoints/step-000002" "$work/skip/checkpoints/step-000003" <<'PY' || fail "skip: checkpoint state differs"
import glob, json, os, struct, sys
a, b = sys.argv[1:]
def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__" and "rng" not in k}
files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(a, "rank-*.safetensors")))
assert files, "no rank files in " + a
for f in files:
    ta, tb = tensors(os.path.join(a, f)), tensors(os.path.join(b, f))
    assert ta.keys() == tb.keys(), f
    bad = [k for k in ta if ta[k] != tb[k]]
    assert not bad, "%s: %s differ" % (f, bad[:3])
print("ok: skip: %d rank files' weights and optimizer state equal the 2-step run's" % len(files))
PY
[ "$status" -eq 0 ] && echo "ok: skip: step 3's update left out; final weights equal the 2-step run's"

out=$("$composer" run --config "$cfg" --out "$work/skips" "${poison[@]}" --set train.steps=6 \
  --set train.on_nonfinite=skip --set train.max_skipped=2 2>&1); code=$?
[ "$code" -eq 5 ] || fail "max_skipped: exit $code, expected 5"
echo "$out" | grep -q 'step 5: .*that is 3 steps in a row (train.max_skipped 2)' ||
  fail "max_skipped: no stop at step 5: $(echo "$out" | tail -2)"
[ "$status" -eq 0 ] && echo "ok: max_skipped 2: steps 3 and 4 skipped, step 5 stopped the job"
exit $status

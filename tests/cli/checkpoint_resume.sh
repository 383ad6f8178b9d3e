#!/usr/bin/env bash
# Distributed checkpoints, end to end:
#  1. a fully_shard (dp 2) run that fails at step 5 after saving steps 2 and 4,
#     run again, resumes from step 4 and ends bit for bit where an
#     uninterrupted run ends (parameters and every logged loss);
#  2. keep_latest_k keeps the newest 2 complete checkpoints, and a folder
#     without index.json (a save cut short) is never resumed from;
#  3. a rank killed (SIGKILL) after writing its file of step 4 and before the
#     index: the run resumes from step 2 and still ends bit for bit;
#  4. the dp-2 checkpoint resumes under other plans (one device, tp 2,
#     fully_shard x tp 2) to within float32 reduction-order error;
#  5. a damaged header, altered tensor bytes, a truncated rank file and a
#     checkpoint of another training config are clear errors (exit 2).
# Usage: checkpoint_resume.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
cfg=configs/parity/fsdp_transformer_dp2.yaml
fail() { echo "FAIL: $*"; exit 1; }

"$composer" run --config "$cfg" --out "$work/straight" --set checkpoint.resume=never >"$work/straight.log" 2>&1 ||
  fail "uninterrupted run: $(tail -3 "$work/straight.log")"
"$composer" run --config "$cfg" --out "$work/cut" --set checkpoint.interval=2 --set debug.fail_rank=1 \
  --set debug.fail_step=5 >"$work/cut1.log" 2>&1 && fail "the injected failure did not fail the run"
[ -f "$work/cut/checkpoints/step-000004/index.json" ] || fail "no complete step-4 checkpoint"
mkdir -p "$work/cut/checkpoints/step-000005"  # a save cut short: no index.json
"$composer" run --config "$cfg" --out "$work/cut" --set checkpoint.interval=2 >"$work/cut2.log" 2>&1 ||
  fail "resumed run: $(tail -3 "$work/cut2.log")"
grep -q "resuming from $work/cut/checkpoints/step-000004 (step 4 of 6)" "$work/cut2.log" ||
  fail "did not resume from step 4: $(grep -m1 resum "$work/cut2.log")"
cmp -s "$work/straight/final.safetensors" "$work/cut/final.safetensors" ||
  fail "the resumed run's final parameters differ from the uninterrupted run's"
losses() { /usr/bin/python3 -c 'import json,sys; print(" ".join("%d:%r" % (j["step"], j["loss"]) for j in map(json.loads, open(sys.argv[1]))))' "$1"; }
[ "$(losses "$work/straight/metrics.jsonl")" = "$(losses "$work/cut/metrics.jsonl")" ] ||
  fail "losses differ: $(losses "$work/straight/metrics.jsonl") vs $(losses "$work/cut/metrics.jsonl")"
echo "ok: resumed at step 4 after a failure at step 5; final parameters and all 6 losses equal bit for bit"

kept=$(cd "$work/cut/checkpoints" && ls -d step-* | tr '\n' ' ')
[ "$kept" = "step-000004 step-000006 " ] || fail "keep_latest_k 2 should leave step-000004 step-000006, found $kept"
echo "ok: kept $kept(step 2 and the cut-short step 5 removed)"

# 3. A rank killed between its file and the index.
"$composer" run --config "$cfg" --out "$work/killed" --set checkpoint.interval=2 --set debug.fail_rank=1 \
  --set debug.fail_step=4 --set debug.fail_at=before_index --set debug.fail_mode=signal >"$work/killed1.log" 2>&1 &&
  fail "the rank killed before the index did not fail the run"
[ -f "$work/killed/checkpoints/step-000004/rank-00001.safetensors" ] || fail "rank 1 did not write its step-4 file"
[ -f "$work/killed/checkpoints/step-000004/index.json" ] && fail "step 4 has an index although rank 1 died before it"
"$composer" run --config "$cfg" --out "$work/killed" --set checkpoint.interval=2 >"$work/killed2.log" 2>&1 ||
  fail "resuming after the kill: $(tail -3 "$work/killed2.log")"
grep -q "resuming from $work/killed/checkpoints/step-000002 (step 2 of 6)" "$work/killed2.log" ||
  fail "did not resume from step 2: $(grep -m1 resum "$work/killed2.log")"
cmp -s "$work/straight/final.safetensors" "$work/killed/final.safetensors" ||
  fail "the run resumed after the kill ends with other parameters"
echo "ok: a rank killed after its file and before step 4's index: resumed from step 2, final parameters bit for bit"

# 4. Resharding (the step-4 checkpoint of fully_shard over 2 ranks).
ck=$work/cut/checkpoints/step-000004
max_diff() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, struct, sys
def read(p):
    raw = open(p, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]; h = json.loads(raw[8:8 + n]); d = raw[8 + n:]
    return {k: struct.unpack("<%df" % ((v["data_offsets"][1] - v["data_offsets"][0]) // 4), d[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in h.items() if k != "__metadata__"}
a, b = read(sys.argv[1]), read(sys.argv[2])
assert a.keys() == b.keys()
print(max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a))
PY
}
for other in transformer tp_transformer_tp2 fsdp2_tp2_transformer; do
  "$composer" run --config configs/parity/$other.yaml --out "$work/$other" --set checkpoint.resume="$ck" \
    >"$work/$other.log" 2>&1 || fail "$other from the dp-2 checkpoint: $(tail -3 "$work/$other.log")"
  d=$(max_diff "$work/straight/final.safetensors" "$work/$other/final.safetensors")
  # The configs' own parameter tolerance against one device: 1e-5.
  /usr/bin/python3 -c "import sys; sys.exit(0 if $d <= 1e-5 else 1)" || fail "$other: max parameter difference $d"
  echo "ok: $other resumed from the dp-2 checkpoint; max parameter difference from the uninterrupted run $d"
done

# 5. Errors.
cp -r "$ck" "$work/damaged"
printf 'x' | dd of="$work/damaged/rank-00001.safetensors" bs=1 seek=200 conv=notrunc 2>/dev/null
"$(dirname "$0")/expect.sh" 2 "rank-00001.safetensors: its header's hash differs from the one index.json records" \
  "$composer" run --config "$cfg" --out "$work/d" --set checkpoint.resume="$work/damaged" || fail "damaged header"
cp -r "$ck" "$work/altered"
at=$(/usr/bin/python3 -c '
import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
print(8 + n + h[sys.argv[2]]["data_offsets"][0] + 5)' "$work/altered/rank-00001.safetensors" layers.1.attention.wq.weight)
printf '\x7f' | dd of="$work/altered/rank-00001.safetensors" bs=1 seek="$at" conv=notrunc 2>/dev/null
"$(dirname "$0")/expect.sh" 2 "rank-00001.safetensors: the bytes of 'layers.1.attention.wq.weight' \(block 0\) differ from the hash index.json records" \
  "$composer" run --config "$cfg" --out "$work/a" --set checkpoint.resume="$work/altered" || fail "altered tensor bytes"
cp -r "$ck" "$work/truncated"
truncate -s 3000 "$work/truncated/rank-00001.safetensors"
"$(dirname "$0")/expect.sh" 2 "rank-00001.safetensors: the file ends at byte 3000 .* it is truncated" \
  "$composer" run --config "$cfg" --out "$work/t" --set checkpoint.resume="$work/truncated" || fail "truncated file"
"$(dirname "$0")/expect.sh" 2 "was saved by a config with another seed, model, train or data section" \
  "$composer" run --config "$cfg" --out "$work/e" --set checkpoint.resume="$ck" --set train.optimizer.lr=0.5 || fail "other config"
"$(dirname "$0")/expect.sh" 2 "is not a complete checkpoint \(no index.json in it\)" \
  "$composer" run --config "$cfg" --out "$work/f" --set checkpoint.resume="$work/cut/checkpoints" || fail "no index"
echo "ok: a damaged header, altered bytes, a truncated file, another config and a folder without index.json are exit-2 errors"

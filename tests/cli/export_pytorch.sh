#!/usr/bin/env bash
# composer export, end to end: a fully_shard (dp 2) run of the tied-weight
# Transformer saves steps 2, 4 and 6; step 4 is exported as one safetensors
# file and, with a tiny --max-shard-size, as Hugging Face shards plus
# model.safetensors.index.json. PyTorch loads each with
# load_state_dict(strict=True) and its loss on step 5's batch equals the loss
# composer logged for step 5 (tools/reference/load_export.py). The export of
# the last step holds final.safetensors' tensors bit for bit, and a missing
# checkpoint or one of another config is an exit-2 error.
# Usage: export_pytorch.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
python=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
rm -rf "$work" && mkdir -p "$work"
cfg=configs/parity/fsdp_transformer_dp2.yaml
fail() { echo "FAIL: $*"; exit 1; }
expect=$(dirname "$0")/expect.sh

"$composer" run --config "$cfg" --out "$work/run" --set checkpoint.interval=2 --set checkpoint.keep_latest_k=3 \
  >"$work/run.log" 2>&1 || fail "training: $(tail -3 "$work/run.log")"
ck=$work/run/checkpoints/step-000004
"$composer" export --config "$cfg" --checkpoint "$ck" --out "$work/one/model.safetensors" >"$work/one.log" 2>&1 ||
  fail "export: $(tail -3 "$work/one.log")"
[ "$(ls "$work/one")" = "model.safetensors" ] || fail "a small export should be one file, found $(ls "$work/one")"
"$python" tools/reference/load_export.py --run-dir "$work/run" --export "$work/one/model.safetensors" --step 4 ||
  fail "PyTorch on the single-file export"

"$composer" export --config "$cfg" --checkpoint "$ck" --out "$work/sharded/model.safetensors" \
  --max-shard-size 2KiB >"$work/sharded.log" 2>&1 || fail "sharded export: $(tail -3 "$work/sharded.log")"
n=$(ls "$work/sharded" | grep -c '^model-[0-9]\{5\}-of-[0-9]\{5\}\.safetensors$')
[ "$n" -ge 3 ] && [ -f "$work/sharded/model.safetensors.index.json" ] ||
  fail "a 2KiB shard size should give several shards and an index, found $(ls "$work/sharded" | tr '\n' ' ')"
"$python" tools/reference/load_export.py --run-dir "$work/run" --export "$work/sharded/model.safetensors.index.json" \
  --step 4 || fail "PyTorch on the sharded export"
echo "ok: $n shards"

"$composer" export --config "$cfg" --checkpoint "$work/run/checkpoints/step-000006" --out "$work/last.safetensors" \
  >"$work/last.log" 2>&1 || fail "export of step 6: $(tail -3 "$work/last.log")"
"$python" - "$work/run/final.safetensors" "$work/last.safetensors" <<'PY' || fail "step 6's export differs from final.safetensors"
import sys
sys.path.insert(0, "tools/reference")
import reference
final, export = reference.read_safetensors(sys.argv[1]), reference.read_safetensors(sys.argv[2])
extra = sorted(set(export) - set(final))  # tied weights under their second name
assert set(final) <= set(export), sorted(set(final) - set(export))
assert all(final[k].dtype == export[k].dtype and final[k].equal(export[k]) for k in final)
print("ok: step 6's export equals final.safetensors bit for bit (%d tensors; also under %s)" % (len(final), extra))
PY

"$expect" 2 "--checkpoint $work/nope: not a complete checkpoint \(no index.json in it\)" \
  "$composer" export --config "$cfg" --checkpoint "$work/nope" --out "$work/x.safetensors" || fail "missing checkpoint"
"$expect" 2 "was saved by a config with another seed, model, train or data section than --config" \
  "$composer" export --config "$cfg" --checkpoint "$ck" --out "$work/x.safetensors" --set train.steps=7 ||
  fail "another config"
"$expect" 2 "composer export needs one of --checkpoint DIR" "$composer" export --config "$cfg" --out "$work/x.safetensors" ||
  fail "no --checkpoint"
echo "ok: a missing checkpoint, another config and no --checkpoint are exit-2 errors"

#!/usr/bin/env bash
# Buffers of transformer_with_shared_params (BatchNorm1d running statistics,
# vocab_bias, the int64 long_buffer) in checkpoints and exports: a train-mode
# fully_shard dp 2 run saves steps 2 and 4; the step-2 export loads into
# PyTorch with load_state_dict(strict=True) and reproduces step 3's loss, and
# holds the buffers with PyTorch's names and dtypes, the running statistics
# moved by rank 0's two forwards (num_batches_tracked 2). A run resumed from
# step 2 ends with the same step-4 checkpoint, buffers included, as the run
# that never stopped (without restored buffers its num_batches_tracked would
# be 2 and its running statistics another pair).
# Usage: shared_params_buffers.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
python=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
rm -rf "$work" && mkdir -p "$work"
cfg=configs/parity/fsdp_transformer_with_shared_params_train_dp2.yaml
fail() { echo "FAIL: $*"; exit 1; }

"$composer" run --config "$cfg" --out "$work/run" --set checkpoint.interval=2 --set checkpoint.resume=never \
  >"$work/run.log" 2>&1 || fail "training: $(tail -3 "$work/run.log")"
"$composer" run --config "$cfg" --out "$work/resumed" --set checkpoint.interval=2 \
  --set "checkpoint.resume=$work/run/checkpoints/step-000002" >"$work/resumed.log" 2>&1 ||
  fail "resumed training: $(tail -3 "$work/resumed.log")"
for k in 2 4; do
  "$composer" export --config "$cfg" --checkpoint "$work/run/checkpoints/step-00000$k" --out "$work/step$k.safetensors" \
    >"$work/export$k.log" 2>&1 || fail "export of step $k: $(tail -3 "$work/export$k.log")"
done
"$composer" export --config "$cfg" --checkpoint "$work/resumed/checkpoints/step-000004" \
  --out "$work/resumed4.safetensors" >"$work/export_resumed.log" 2>&1 || fail "export: $(tail -3 "$work/export_resumed.log")"
"$python" tools/reference/load_export.py --run-dir "$work/run" --export "$work/step2.safetensors" --step 2 ||
  fail "PyTorch on the step-2 export"
"$python" - "$work/step2.safetensors" "$work/step4.safetensors" "$work/resumed4.safetensors" <<'PY' || fail "buffers"
import sys
import torch
sys.path.insert(0, "tools/reference")
import reference
s2, s4, r4 = (reference.read_safetensors(p) for p in sys.argv[1:4])
assert s2["vocab_bias"].equal(torch.ones(16)), s2["vocab_bias"]
assert s2["long_buffer"].dtype == torch.int64 and s2["long_buffer"].equal(torch.zeros(16, dtype=torch.int64))
assert s2["bn.num_batches_tracked"].dtype == torch.int64 and s2["bn.num_batches_tracked"].shape == ()
assert s2["bn.num_batches_tracked"].item() == 2, s2["bn.num_batches_tracked"]
assert not s2["bn.running_mean"].equal(torch.zeros(2)) and not s2["bn.running_var"].equal(torch.ones(2))
assert s4["bn.num_batches_tracked"].item() == 4 and not s4["bn.running_mean"].equal(s2["bn.running_mean"])
bad = [k for k in s4 if not (s4[k].dtype == r4[k].dtype and s4[k].equal(r4[k]))]
assert set(s4) == set(r4) and not bad, bad
print("ok: buffers in the exports; the resumed run's step-4 checkpoint equals the uninterrupted one (%d tensors)"
      % len(s4))
PY

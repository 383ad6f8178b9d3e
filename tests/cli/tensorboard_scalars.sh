#!/usr/bin/env bash
# metrics.tensorboard, read back by the tensorboard package's own reader
# (EventAccumulator over its record reader, which checks every record's CRCs):
# fully_shard dp 2 for 4 steps writes one event file in DIR with every number
# of every metrics.jsonl line as a scalar of the same step (float32, as
# TensorBoard stores them), and each rank's run DIR/rank<R> holds its memory
# per step, equal to its memory.rank<R>.json. A byte flipped in the event file
# makes the record reader raise DataLossError, so the checksums it accepted
# are the right ones.
# Usage: tensorboard_scalars.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
python=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
rm -rf "$work"
"$composer" run --config configs/bench/fsdp_dp2.yaml --out "$work/run" --set checkpoint.enabled=false \
  --set train.steps=4 --set metrics.tensorboard="$work/tb" >"$work.log" 2>&1 || { cat "$work.log"; exit 1; }
exec "$python" - "$work" <<'PY'
import glob, json, shutil, sys
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

work = sys.argv[1]
ok = True


def scalars(path):
    ea = EventAccumulator(path, size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def flatten(line):
    for key, v in line.items():
        if key == "step" or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            yield key, v
        elif isinstance(v, dict):
            yield from ((f"{key}/{k}", x) for k, x in v.items())
        elif isinstance(v, list):
            yield from ((f"{key}/{i}", x) for i, x in enumerate(v))


files = glob.glob(f"{work}/tb/events.out.tfevents.*")
lines = [json.loads(l) for l in open(f"{work}/run/metrics.jsonl")]
tb = scalars(f"{work}/tb")
want = {(k, l["step"]): v for l in lines for k, v in flatten(l)}
wrong = [(k, s, v, tb.get(k, {}).get(s)) for (k, s), v in want.items() if tb.get(k, {}).get(s) != np.float32(v)]
extra = [(k, s) for k, steps in tb.items() for s in steps if (k, s) not in want]
print(f"event files {len(files)}; {len(want)} numbers in metrics.jsonl over {len(lines)} steps; "
      f"tags {sorted(tb)}; mismatched {wrong[:5]}; in TensorBoard only {extra[:5]}")
ok &= len(files) == 1 and len(lines) == 4 and not wrong and not extra
ok &= {"loss", "grad_norm", "lr", "step_ms", "samples_per_s", "peak_alloc_mb", "comm_bytes_by_group/dp"} <= set(tb)

for rank in (0, 1):
    mine = scalars(f"{work}/tb/rank{rank}")
    peaks = json.load(open(f"{work}/run/memory.rank{rank}.json"))["step_peak_bytes"]
    got = [mine["peak_alloc_mb"][s] for s in range(1, 5)]
    equal = got == [np.float32(b / 2**20) for b in peaks]
    print(f"rank {rank}: peak_alloc_mb per step {got}, equal to memory.rank{rank}.json: {equal}")
    ok &= equal

from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow


def records(path):  # every record through the reader's CRC checks; DataLossError on a bad one
    reader, n = pywrap_tensorflow.PyRecordReader_New(path), 0
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return n
        n += 1


count = records(files[0])
print(f"records that passed the reader's CRC checks: {count} (the version and one per step)")
ok &= count == 5
bad = f"{work}/corrupt.tfevents"
data = bytearray(open(files[0], "rb").read())
data[len(data) // 2] ^= 0x40
open(bad, "wb").write(data)
try:
    records(bad)
    print("a corrupted event file passed the reader's checks")
    ok = False
except errors.DataLossError as e:
    print(f"a corrupted event file is refused: {e.message if hasattr(e, 'message') else e}")
sys.exit(0 if ok else 1)
PY

#!/usr/bin/env bash
# The default experiment trains on its 4 ranks and its loss falls: after 40 steps
# the loss is below a quarter of the first step's. Usage: quickstart_learns.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
rm -rf "$work"
"$composer" --config configs/quickstart.yaml --set train.steps=40 --out "$work" >/dev/null
exec /usr/bin/python3 - "$work/metrics.jsonl" <<'PY'
import json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1])]
first, last = losses[0], losses[-1]
print(f"loss {first:.4f} -> {last:.4f} over {len(losses)} steps")
sys.exit(0 if len(losses) == 40 and last < first / 4 else 1)
PY

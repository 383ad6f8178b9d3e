#!/usr/bin/env bash
# A golden whose step-3 loss is off by 1% must make `composer check` exit 1 and
# name step 3 as the first divergence. Usage: golden_mismatch.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
mkdir -p "$work"
/usr/bin/python3 - "$work/perturbed.json" <<'PY'
import json, sys
g = json.load(open("tests/golden/mlp_module.json"))
g["steps"][2]["loss"] *= 1.01
json.dump(g, open(sys.argv[1], "w"))
PY
exec "$(dirname "$0")/expect.sh" 1 "first divergence: step 3 loss: expected" \
  "$composer" check --config configs/parity/mlp_module.yaml --out "$work/run" --set "check.golden=$work/perturbed.json"

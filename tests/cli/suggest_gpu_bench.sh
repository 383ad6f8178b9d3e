#!/usr/bin/env bash
# composer suggest --rates SUMMARY: tools/gpu-bench's summary.json as a GPU's rates. The matmul
# rate is composer's step there (the model's FLOPs per step over the median step), printed in
# the output and in the suggested config's header.
# Usage: suggest_gpu_bench.sh COMPOSER PYTHON SUMMARY WORK_DIR
set -euo pipefail
composer=$1 python=$2 summary=$3 work=$4
rm -rf "$work" && mkdir -p "$work"
want=$("$python" -c 'import json, sys; s = json.load(open(sys.argv[1]))
print("%.4g" % (s["model_flops_per_step"] / (s["rows"]["composer"]["step_ms"] / 1e3) / 1e12))' "$summary")
"$composer" suggest --config configs/examples/llama3_8b_tp8_dp8.yaml --ranks-per-node 8 --nodes 8 \
  --rates "$summary" --out "$work/" >"$work/out.txt"
line="tools/gpu-bench on cpu ($summary): composer's step at $want TFLOP/s as the matmul rate"
grep -qF "$line" "$work/out.txt" || { echo "FAIL: the output does not name the rate: $line"; cat "$work/out.txt"; exit 1; }
grep -q '^#.*'"composer's step at $want TFLOP/s" "$work/suggested.yaml" ||
  { echo "FAIL: suggested.yaml's header does not name the rate"; head -20 "$work/suggested.yaml"; exit 1; }
echo "ok: $line"

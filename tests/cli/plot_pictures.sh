#!/usr/bin/env bash
# tools/plot's three pictures from real runs, read back as images: a composed
# plan's loss against its golden (largest relative error within the config's
# loss_rtol), the same plan with debug.inject: microbatch_off_by_one (its error
# drawn and reported orders of magnitude larger), both runs on one chart, and
# the pipeline step as a Gantt chart whose reported bubble is metrics.jsonl's.
# Usage: plot_pictures.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
python=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
rm -rf "$work"
cfg=configs/parity/fsdp2_pp2_1f1b_transformer_tied.yaml
"$composer" run --config $cfg --out "$work/plan" --set checkpoint.enabled=false >"$work.log" 2>&1 || { cat "$work.log"; exit 1; }
"$composer" run --config $cfg --out "$work/off_by_one" --set checkpoint.enabled=false --set debug.inject=microbatch_off_by_one \
  >>"$work.log" 2>&1 || { cat "$work.log"; exit 1; }
tools/plot loss "$work/plan" | tee "$work/loss.txt"
tools/plot loss "$work/off_by_one" | tee "$work/loss_x2.txt"
tools/plot runs "$work/plan" "$work/off_by_one" --out "$work/runs.png" | tee "$work/runs.txt"
tools/plot schedule "$work/plan" | tee "$work/schedule.txt"
exec "$python" - "$work" <<'PY'
import json, re, sys
import matplotlib.image as mpimg
work = sys.argv[1]
ok = True
for png in ("plan/loss.png", "off_by_one/loss.png", "runs.png", "plan/schedule.png"):
    img = mpimg.imread(f"{work}/{png}")
    colours = len({tuple(p) for p in img.reshape(-1, img.shape[-1])[::97]})
    print(f"{png}: {img.shape[1]}x{img.shape[0]} pixels, {colours} colours sampled")
    ok &= img.shape[0] > 200 and img.shape[1] > 400 and colours > 5
err = lambda f: float(re.search(r"largest relative error (\S+)", open(f"{work}/{f}").read()).group(1))  # noqa: E731
rtol = json.load(open(f"{work}/plan/config.resolved.json"))["check"]["loss_rtol"]
print(f"largest relative error: plan {err('loss.txt')}, off_by_one {err('loss_x2.txt')} (loss_rtol {rtol})")
ok &= err("loss.txt") <= rtol and err("loss_x2.txt") > 1e3 * rtol
last = [json.loads(l) for l in open(f"{work}/plan/metrics.jsonl")][-1]
text = open(f"{work}/schedule.txt").read()
want = f"bubble measured {last['pipeline_bubble']:.1%}, formula {last['pipeline_bubble_formula']:.1%}"
print(f"schedule: {text.strip()}; metrics.jsonl says {want}")
ok &= want in text and "4 ranks" in text
ok &= "2 runs" in open(f"{work}/runs.txt").read()
sys.exit(0 if ok else 1)
PY

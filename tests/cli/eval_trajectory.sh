#!/usr/bin/env bash
# Eval does not change training: a run with eval (eval.every) and the same run
# without it train the same model bit for bit (every loss and gradient norm in
# metrics.jsonl, and final.safetensors byte for byte), on one device and under
# pipeline x tensor_parallel (sp) x fully_shard (8 ranks). A held-out token
# file as eval.data: the eval loss appears in metrics.jsonl and the progress
# line, and equals the loss of the final weights on that file's windows
# computed by the PyTorch reference (tools/reference) at the last step.
# Usage: eval_trajectory.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
python=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
rm -rf "$work" && mkdir -p "$work"
compare() {  # the training records and final weights of two runs
  "$python" - "$1" "$2" <<'PY'
import json, sys
a, b = sys.argv[1], sys.argv[2]
def records(run):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(f"{run}/metrics.jsonl"))]
ra, rb = records(a), records(b)
if ra != rb:
    sys.exit(f"FAIL: {a} and {b} trained differently: {ra} vs {rb}")
evals = [r["eval_loss"] for r in map(json.loads, open(f"{a}/metrics.jsonl")) if "eval_loss" in r]
if not evals or any("eval_loss" in r for r in map(json.loads, open(f"{b}/metrics.jsonl"))):
    sys.exit(f"FAIL: {a} should have eval losses ({evals}) and {b} none")
print(f"ok: {len(ra)} steps equal bit for bit with and without eval; eval losses {evals}")
PY
  cmp "$1/final.safetensors" "$2/final.safetensors" || { echo "FAIL: final weights differ with eval"; exit 1; }
}
for cfg in configs/parity/llama_eval.yaml configs/parity/pp2_tp2_fsdp2_eval_llama.yaml; do
  name=$(basename "$cfg" .yaml)
  "$composer" run --config "$cfg" --out "$work/$name.eval" >"$work/$name.eval.log"
  "$composer" run --config "$cfg" --set eval.every=0 --out "$work/$name.none" >"$work/$name.none.log"
  compare "$work/$name.eval" "$work/$name.none"
  grep -q "eval_loss [0-9]" "$work/$name.eval.log" || { echo "FAIL: no eval_loss in the progress line"; exit 1; }
done

# Held-out tokens: a llama on one token file, evaluated on another.
"$python" - "$work" <<'PY'
import numpy as np, sys
rng = np.random.default_rng(5)
rng.integers(0, 64, size=4000).astype("<u2").tofile(f"{sys.argv[1]}/train.bin")
rng.integers(0, 64, size=3000).astype("<u2").tofile(f"{sys.argv[1]}/heldout.bin")
PY
cat >"$work/tokens_eval.yaml" <<YAML
name: tokens_eval
seed: 1
model:
  name: llama
  args: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, vocab_size: 64, multiple_of: 32, max_seq_len: 32}
mesh: {shape: [2], names: [dp]}
parallelize:
  - fully_shard: {mesh_dim: dp}
train:
  steps: 3
  global_batch: 4
  optimizer: {name: sgd, lr: 0.5}
  loss: {name: cross_entropy}
data: {source: tokens, path: $work/train.bin, seq_len: 16}
eval: {every: 3, batches: 3, data: {source: tokens, path: $work/heldout.bin}}
YAML
"$composer" run --config "$work/tokens_eval.yaml" --out "$work/tokens_eval" >"$work/tokens_eval.log"
"$python" - "$work/tokens_eval" <<'PY'
import json, sys, os, torch
sys.path.insert(0, "tools/reference")
import models
from reference import Data, load_config, loss_fn, read_safetensors
run = sys.argv[1]
cfg = load_config(run)
ecfg = dict(cfg, seed=cfg["seed"] ^ 0x6576616C2D736565)
ecfg["data"] = dict(cfg["data"], **{k: v for k, v in cfg["eval"]["data"].items()})
data = Data(ecfg, torch.float32)
model = models.build(cfg["model"]["name"], cfg["model"]["args"])
final = read_safetensors(f"{run}/final.safetensors")
with torch.no_grad():
    for n, p in model.named_parameters():
        p.copy_(final[n])
model.eval()
B = cfg["train"]["global_batch"]
with torch.no_grad():
    want = sum(loss_fn(cfg["train"]["loss"], model(x), y, B, B).item()
               for x, y in (data.batch(j, 0, B) for j in range(1, cfg["eval"]["batches"] + 1))) / cfg["eval"]["batches"]
got = [json.loads(l) for l in open(f"{run}/metrics.jsonl")][-1]["eval_loss"]
err = abs(got - want) / abs(want)
print(f"held-out tokens: eval_loss {got:.7g}, PyTorch on the final weights {want:.7g}, rel err {err:.3g}")
if err > 1e-5:
    sys.exit("FAIL: the eval loss is not the final model's loss on the held-out windows")
PY
echo "eval_trajectory: passed"

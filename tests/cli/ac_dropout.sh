#!/usr/bin/env bash
# Activation checkpointing changes no value: the Transformer with dropout 0.1
# trains 4 steps of 2 microbatches with and without checkpointing its 3
# blocks, and the losses, gradient norms and final weights are bit-equal; each
# step recomputes 3 blocks x 2 microbatches. Usage: ac_dropout.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
rm -rf "$work"
common=(--config configs/parity/transformer.yaml --set model.args.dropout_p=0.1 --set train.steps=4 --set train.threads=1)
"$composer" run "${common[@]}" --out "$work/plain" >/dev/null
"$composer" run "${common[@]}" --out "$work/ac" \
  --set "parallelize=[{activation_checkpointing: {units: ['layers.*']}}]" >/dev/null
exec /usr/bin/python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
def steps(run):
    return [json.loads(l) for l in open(f"{work}/{run}/metrics.jsonl")]
plain, ac = steps("plain"), steps("ac")
same = [(a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]) for a, b in zip(plain, ac)]
weights = open(f"{work}/plain/final.safetensors", "rb").read() == open(f"{work}/ac/final.safetensors", "rb").read()
recomputes = [s.get("recomputes") for s in ac]
print(f"losses {[s['loss'] for s in plain]}; bit-equal per step {same}; final weights equal {weights}; "
      f"recomputes per step {recomputes}")
sys.exit(0 if len(plain) == 4 and all(same) and weights and recomputes == [6] * 4 else 1)
PY

#!/usr/bin/env python3
"""Proves that PyTorch loads `composer export`'s weights and computes what composer did.

Builds the reference model of a composer run (config.resolved.json in --run-dir),
loads the exported weights of the run's step-K checkpoint with
load_state_dict(strict=True) (a single safetensors file, or a Hugging Face
model.safetensors.index.json and its shards), and computes the loss of step
K + 1's global batch, forward only. Composer computes step K + 1's loss before
that step's update, from the weights of step K, so it must equal the loss
composer logged for step K + 1 (metrics.jsonl) within the config's per-step
loss tolerances (check.loss_rtol, check.loss_atol: those composer's golden
checks use against PyTorch). Exits 1 otherwise.

    .venv/bin/python tools/reference/load_export.py --run-dir runs/x --export x.safetensors --step 4
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import reference  # noqa: E402


def read_export(path):
    """The tensors of one safetensors file, or of every shard a Hugging Face index names."""
    if not path.endswith(".index.json"):
        return reference.read_safetensors(path)
    with open(path) as f:
        index = json.load(f)
    folder = os.path.dirname(path)
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, t in reference.read_safetensors(os.path.join(folder, shard)).items():
            if index["weight_map"].get(name) != shard:
                sys.exit(f"{path}: {name} is in {shard} but the weight map says {index['weight_map'].get(name)}")
            state[name] = t
    total = sum(t.numel() * t.element_size() for t in state.values())
    if total != index["metadata"]["total_size"]:
        sys.exit(f"{path}: total_size {index['metadata']['total_size']} but the shards hold {total} bytes")
    return state


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="the composer run that saved the checkpoint")
    ap.add_argument("--export", required=True, help="composer export's output: FILE.safetensors or the .index.json")
    ap.add_argument("--step", type=int, required=True, help="the exported checkpoint's step K")
    args = ap.parse_args()

    cfg = reference.load_config(args.run_dir)
    t = cfg["train"]
    dtype = reference.DTYPES[t["dtype"]]
    torch.set_num_threads(max(1, t["threads"] or os.cpu_count()))
    model = models.build(cfg["model"]["name"], cfg["model"]["args"])
    state = read_export(args.export)
    model.load_state_dict(state, strict=True)  # raises on a missing, unexpected or mis-shaped tensor
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.train()  # composer's loss is a training-mode forward

    step = args.step + 1
    with open(os.path.join(args.run_dir, "metrics.jsonl")) as f:
        logged = {r["step"]: r["loss"] for r in map(json.loads, f)}
    if step not in logged:
        sys.exit(f"{args.run_dir}/metrics.jsonl has no step {step}: train past the exported step")
    data = reference.Data(cfg, dtype)
    B, M = t["global_batch"], t["microbatches"]
    mb = B // M
    loss = 0.0
    with torch.no_grad():
        for m in range(M):
            x, y = data.batch(step, m * mb, (m + 1) * mb)
            loss += reference.loss_fn(t["loss"], model(x), y, mb, B).item()
    rtol, atol = cfg["check"]["loss_rtol"], cfg["check"]["loss_atol"]
    err = abs(loss - logged[step])
    ok = err <= atol + rtol * abs(logged[step])
    print(f"{'ok' if ok else 'FAIL'}: {len(state)} tensors loaded strictly from {args.export}; step {step} loss "
          f"{loss!r} (PyTorch) vs {logged[step]!r} (composer), abs err {err:.3g}, allowed {atol + rtol * abs(logged[step]):.3g}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

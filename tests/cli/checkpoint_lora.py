#!/usr/bin/env python3
"""Checkpoints of a LoRA run hold the adapters and their optimizer state, and name the frozen base.

The model of configs/parity/qwen3_lora_mb4.yaml (rank-4 adapters on every attention and MLP Linear,
SGD) starts from a base file given as model.init_from (its golden's initial weights less the adapters).

- Saved under tp 2 (sequence parallel) x fully_shard dp 2 every 2 steps: each index.json lists only
  adapter tensors (and their optimizer state, none for plain SGD) and records the base as
  {init_from: path, content_fnv1a64: hash}; the rank files hold no base tensor.
- Resumed from step 2 under another plan (fully_shard dp 2), steps 3 and 4 give the single-device run's
  losses, and the final weights (base and adapters) equal its final weights, within float32 tolerance.
- With the base file changed (one value), resuming is refused before launch (exit 2) naming
  model.init_from.
- `composer export --format pt --merge` of the step-4 checkpoint (the base read from init_from) equals
  the merged export of the single-device run's final weights.
- A base drawn from the seed (no init_from): the index records {drawn_from_seed: 0}, and the merged
  export of the step-4 checkpoint equals that of the run's final weights bit for bit.

Usage: checkpoint_lora.py COMPOSER WORK_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

COMPOSER, WORK = sys.argv[1], sys.argv[2]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "parity", "qwen3_lora_mb4.yaml")
INIT = os.path.join(ROOT, "tests", "golden", "qwen3_lora_mb4.init.safetensors")
RTOL, ATOL = 1e-5, 1e-6  # the config's float32 check tolerances (reduction order only)
TP_FSDP = """mesh: {shape: [2, 2], names: [dp, tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp, sequence_parallel: true}
  - fully_shard: {mesh_dim: dp}
"""
FSDP = """mesh: {shape: [2], names: [dp]}
parallelize:
  - fully_shard: {mesh_dim: dp}
"""


def fail(msg):
    print("checkpoint_lora: FAILED: " + msg)
    sys.exit(1)


def composer(*args, expect=0):
    r = subprocess.run([COMPOSER, *args], capture_output=True, text=True)
    if r.returncode != expect:
        fail(f"composer {' '.join(args)} exited {r.returncode}, expected {expect}:\n{r.stdout[-3000:]}\n"
             f"{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def write_config(name, base, plan="", extra=""):
    text = open(CONFIG).read()
    text = re.sub(r"^name: .*$", f"name: {name}", text, flags=re.M)
    if base:
        text = text.replace("  name: qwen3\n", f"  name: qwen3\n  init_from: {base}\n", 1)
    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        f.write(text + plan + extra)
    return path


def run(config, *sets):
    out = os.path.join(WORK, os.path.basename(config)[:-5])
    shutil.rmtree(out, ignore_errors=True)
    composer("run", "--config", config, "--out", out, *sets)
    return out


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def index_of(ckpt):
    with open(os.path.join(ckpt, "index.json")) as f:
        return json.load(f)


def check_trained_only(ckpt, base_record):
    index = index_of(ckpt)
    keys = sorted(index["tensors"])
    if not keys or any("lora_" not in k for k in keys):
        fail(f"{ckpt} holds tensors other than the adapters: {[k for k in keys if 'lora_' not in k]}")
    if index.get("frozen_base") != base_record:
        fail(f"{ckpt}: frozen_base is {index.get('frozen_base')}, expected {base_record}")
    stored = set()
    for f in os.listdir(ckpt):
        if f.endswith(".safetensors"):
            stored |= set(load_file(os.path.join(ckpt, f)))
    base_in_files = [k for k in stored if "lora_" not in k and not k.startswith("rng")]
    if base_in_files:
        fail(f"{ckpt}'s rank files hold base tensors: {base_in_files}")
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    print(f"{ckpt}: {len(keys)} adapter tensors, {size} bytes on disk; frozen_base {index['frozen_base']}")


def compare(got, want, what):
    worst = 0.0
    for k in want:
        if k not in got:
            fail(f"{what}: no tensor {k}")
        err = (got[k].double() - want[k].double()).abs().max().item()
        worst = max(worst, err)
        if not torch.allclose(got[k].double(), want[k].double(), rtol=RTOL, atol=ATOL):
            fail(f"{what}: {k} differs by {err:.3g}")
    if set(got) != set(want):
        fail(f"{what}: tensors {sorted(set(got) ^ set(want))} on one side only")
    print(f"{what}: {len(want)} tensors, worst abs err {worst:.3g}")


def merged(config, out, *source):
    composer("export", "--config", config, *source, "--format", "pt", "--merge", "--out", out)
    return load_file(out)


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    base = os.path.join(WORK, "base.safetensors")
    save_file({k: v for k, v in load_file(INIT).items() if "lora_" not in k}, base, metadata={"format": "pt"})

    saver = write_config("lora_tp_fsdp", base, TP_FSDP, "checkpoint: {interval: 2}\n")
    single = write_config("lora_single", base)
    run_saver, run_single = run(saver), run(single)
    record = index_of(os.path.join(run_saver, "checkpoints", "step-000002"))["frozen_base"]
    if set(record) != {"init_from", "content_fnv1a64"} or record["init_from"] != base:
        fail(f"frozen_base {record} does not name the base file {base} and its hash")
    for step in ("step-000002", "step-000004"):
        check_trained_only(os.path.join(run_saver, "checkpoints", step), record)

    resumer = write_config("lora_fsdp_resumed", base, FSDP)
    step2 = os.path.join(run_saver, "checkpoints", "step-000002")
    run_resumed = run(resumer, "--set", f"checkpoint.resume={step2}")
    got, want = losses(run_resumed), losses(run_single)
    if sorted(got) != [3, 4]:
        fail(f"the resumed run trained steps {sorted(got)}, expected 3 and 4")
    errs = [abs(got[s] - want[s]) / abs(want[s]) for s in (3, 4)]
    print(f"resumed under fully_shard dp 2 from step 2 of tp 2 x fully_shard dp 2: losses {got}, one device "
          f"{ {s: want[s] for s in (3, 4)} }, rel err {['%.2g' % e for e in errs]}")
    if max(errs) > RTOL:
        fail(f"the resumed losses differ from one device's by {max(errs):.3g} relative")
    compare(load_file(os.path.join(run_resumed, "final.safetensors")),
            load_file(os.path.join(run_single, "final.safetensors")), "resumed final weights vs one device's")

    # Another base under the same path: the checkpoint's adapters were not trained on it.
    original = load_file(base)
    changed = dict(original)
    name = sorted(changed)[0]
    changed[name] = changed[name].clone()
    changed[name].view(-1)[0] += 1.0
    save_file(changed, base, metadata={"format": "pt"})
    out = composer("run", "--config", resumer, "--out", os.path.join(WORK, "refused"),
                   "--set", f"checkpoint.resume={step2}", expect=2)
    if "model.init_from" not in out or "holds only the parameters that train" not in out:
        fail(f"resuming on a changed base was not refused naming model.init_from: {out}")
    print("a changed base:", out.strip().splitlines()[-1])
    save_file(original, base, metadata={"format": "pt"})

    compare(merged(saver, os.path.join(WORK, "merged_ckpt.safetensors"), "--checkpoint",
                   os.path.join(run_saver, "checkpoints", "step-000004")),
            merged(single, os.path.join(WORK, "merged_single.safetensors"), "--weights",
                   os.path.join(run_single, "final.safetensors")),
            "merged export of the step-4 checkpoint (base from init_from) vs of one device's final weights")

    drawn = write_config("lora_drawn", "", "", "checkpoint: {interval: 2}\n")
    run_drawn = run(drawn)
    check_trained_only(os.path.join(run_drawn, "checkpoints", "step-000004"), {"drawn_from_seed": 0})
    a = merged(drawn, os.path.join(WORK, "merged_drawn_ckpt.safetensors"), "--checkpoint",
               os.path.join(run_drawn, "checkpoints", "step-000004"))
    b = merged(drawn, os.path.join(WORK, "merged_drawn_final.safetensors"), "--weights",
               os.path.join(run_drawn, "final.safetensors"))
    if set(a) != set(b) or not all(torch.equal(a[k], b[k]) for k in a):
        fail("the merged export of a drawn base's checkpoint differs from that of the run's final weights")
    print(f"drawn base: the merged export of the step-4 checkpoint equals the final weights' ({len(a)} tensors, "
          "bit for bit)")
    print("checkpoint_lora: passed")


main()

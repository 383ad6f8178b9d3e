#!/usr/bin/env python3
"""composer -> PyTorch DCP: loads a composer checkpoint's step folder with PyTorch's own
torch.distributed.checkpoint.load and HuggingFaceStorageReader into the PyTorch reference Llama
(torchtitan's FQNs) and torch.optim.AdamW, on --procs Gloo processes (fully_shard over them when
more than one: PyTorch does the resharding), as a torchtitan user would:

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd = {**model_sd, **{"optimizer." + k: v for k, v in optim_sd.items() if k.startswith("state.")}}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(step_dir))
    set_state_dict(model, optimizer, model_state_dict=..., optim_state_dict=...)

Then checks, on the model and optimizer themselves:
  - every parameter equals composer's export of the same checkpoint (`composer export`) bit for bit;
  - every exp_avg and exp_avg_sq equals the checkpoint's pieces put together by index.json's offsets
    (the safetensors library's reader, not DCP's), bit for bit, and every step equals the index's
    optimizer step count.

    dcp_load.py --run-dir RUN --step-dir RUN/checkpoints/step-000005 --export EXPORT.safetensors --procs 3
"""
import argparse
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "reference"))
import reference  # noqa: E402


def assembled(step_dir, key, index):
    """Tensor `key` of the checkpoint, its chunks placed by index.json's offsets."""
    e = index["tensors"][key]
    out = torch.empty(e["shape"], dtype=getattr(torch, {"F32": "float32", "BF16": "bfloat16"}[e["dtype"]]))
    for ch in e["chunks"]:
        with safe_open(os.path.join(step_dir, ch["file"]), "pt") as f:
            t = f.get_tensor(key)
        out[tuple(slice(o, o + s) for o, s in zip(ch["offset"], ch["size"]))] = t
    return out


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def worker(rank, args, init_file):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=args.procs)
    cfg = reference.load_config(args.run_dir)
    model = reference.build_model(cfg, args.run_dir, "dcp_load")
    if args.procs > 1:
        mesh = init_device_mesh("cpu", (args.procs,))
        layers = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
        for layer in layers:  # torchtitan's units: each block, then the root
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    o = cfg["train"]["optimizer"]
    assert o["name"] == "adamw", o
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    params = {n for n, _ in model.named_parameters()}  # the rotary table is a buffer composer computes
    sd = {k: v for k, v in model_sd.items() if k in params}
    sd.update({"optimizer." + k: v for k, v in optim_sd.items() if k.startswith("state.")})
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(args.step_dir))
    optim_sd.update({k[len("optimizer."):]: v for k, v in sd.items() if k.startswith("optimizer.")})
    model_sd.update({k: v for k, v in sd.items() if k in params})
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)

    # Every rank takes part in the gathers; rank 0 compares.
    index = json.load(open(os.path.join(args.step_dir, "index.json")))
    export = load_file(args.export) if rank == 0 else None
    bad, checked = [], 0
    for n, p in model.named_parameters():
        value = full(p.detach())
        state = {s: full(opt.state[p][s]) for s in ("exp_avg", "exp_avg_sq", "step")}
        if rank != 0:
            continue
        checked += 1
        if not torch.equal(value, export[n]):
            bad.append(f"{n}: differs from the export by up to {(value - export[n]).abs().max().item():.3g}")
        for s in ("exp_avg", "exp_avg_sq"):
            want = assembled(args.step_dir, f"optimizer.state.{n}.{s}", index)
            if not torch.equal(state[s], want):
                bad.append(f"{n} {s}: differs from the checkpoint's by up to {(state[s] - want).abs().max().item():.3g}")
        if state["step"].item() != index["optimizer"]["steps"]:
            bad.append(f"{n} step {state['step'].item()} != the index's {index['optimizer']['steps']}")
    if rank == 0:
        if bad or checked == 0:
            print("FAIL: " + ("; ".join(bad[:6]) if bad else "no parameter checked"))
            sys.exit(1)
        print(f"ok: dcp.load on {args.procs} process(es): {checked} parameters equal the export bit for bit, "
              f"their exp_avg and exp_avg_sq equal the checkpoint's, step {index['optimizer']['steps']}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step-dir", required=True)
    ap.add_argument("--export", required=True)
    ap.add_argument("--procs", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcp_load") as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.procs, start_method="spawn")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Reads a PyTorch Distributed Checkpoint (DCP) folder, such as torchtitan's
`step-N`, for composer's `checkpoint.resume_from_dcp` (docs/checkpoints.md#pytorch-dcp).

composer runs this with the project's Python; it needs nothing but torch and
safetensors. PyTorch's own reader does the reading: FileSystemReader's
`.metadata` (a pickle only PyTorch reads) says what the folder holds, and
`torch.distributed.checkpoint.load` in this one process reads each tensor
whole, whatever ranks and shards saved it (PyTorch does the resharding). The
tensors go, under their DCP names, into safetensors files of at most
--file-bytes each in OUT (parts-00000.safetensors, ...), which composer then
writes as the rank files of a checkpoint of its own, with its hashes and index.
Only one file's tensors are in memory at a time.

OUT/manifest.json says what the folder holds beside its tensors:
  step        torchtitan's train_state.step (a tensor or pickled bytes)
  files       the parts files, in order
  renamed     torchtitan's names the parts hold under composer's (RENAMES: --model's)
  tensors     every tensor: name, dtype, shape
  computed    the rotary tables (freqs_cis), which composer computes from model.args
  objects     every non-tensor entry (optimizer.param_groups.*, lr_scheduler.*,
              dataloader.*, train_state.* other than step, ...): its value as
              JSON where it has one, else its Python type and repr
composer reports by name what it does not take.

    .venv/bin/python tools/dcp_import.py --dcp CKPT/step-10 --out STAGING
"""
import argparse
import io
import json
import math
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata


# torchtitan's checkpoint entries beside the model and the optimizer (components/checkpoint.py).
LOOP_STATE = ("train_state", "lr_scheduler", "dataloader")

# torchtitan's names that differ from composer's, per composer model. Llama 3: torchtitan's main
# (b5bcd76, 2026-08) puts wq, wk and wv under attention.qkv_linear and calls the head lm_head; its
# earlier releases used composer's names. Each rule renames a name's part (parameters and
# optimizer.state.<fqn>.* alike); every other model takes the names as they are.
RENAMES = {"llama": [(".attention.qkv_linear.", ".attention."), ("lm_head.", "output.")]}


def composer_name(name, rules):
    """`name` (a parameter's, or optimizer.state.<fqn>.<name>) with torchtitan's parts renamed to
    composer's: a rule starting with "." anywhere in the FQN, another at its start."""
    prefix = "optimizer.state." if name.startswith("optimizer.state.") else ""
    fqn = name[len(prefix):]
    for old, new in rules:
        if old.startswith("."):
            fqn = fqn.replace(old, new)
        elif fqn.startswith(old):
            fqn = new + fqn[len(old):]
    return prefix + fqn


def fail(msg):
    sys.stderr.write(f"dcp_import: {msg}\n")
    sys.exit(2)


def as_json(v):
    """A JSON value for v where it has one (numbers, strings, lists, dicts of them, 0-d and small tensors), else None."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else (v.tolist() if v.numel() <= 64 else None)
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, (list, tuple)):
        items = [as_json(x) for x in v]
        return None if any(x is None and y is not None for x, y in zip(items, v)) else items
    if isinstance(v, dict):
        out = {str(k): as_json(x) for k, x in v.items()}
        return None if any(out[str(k)] is None and x is not None for k, x in v.items()) else out
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dcp", required=True, help="the DCP folder (holds .metadata and *.distcp)")
    ap.add_argument("--out", required=True, help="an empty or new folder for the parts and manifest.json")
    ap.add_argument("--file-bytes", type=int, default=1 << 30, help="bytes per parts file (default 1 GiB)")
    ap.add_argument("--model", default="", help="composer's model name, for its renames of torchtitan's names")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.dcp, ".metadata")):
        fail(f"{args.dcp} is not a DCP checkpoint folder: it has no .metadata (give the step-N folder "
             "torchtitan's checkpoint.folder holds)")
    try:
        reader = FileSystemReader(args.dcp)
        md = reader.read_metadata()
    except Exception as e:  # a damaged or foreign .metadata
        fail(f"{args.dcp}/.metadata: PyTorch cannot read it: {type(e).__name__}: {e}")
    os.makedirs(args.out, exist_ok=True)
    # One process reads it all: the no_dist default, said once here rather than at every load.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    # Model and optimizer tensors go to the parts; the training loop's own state (a tensor or not) is an object.
    tensors, objects, small, computed = {}, [], {}, []
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata) and fqn.split(".")[-1] == "freqs_cis":
            computed.append(fqn)  # a rotary table (torchtitan keeps it as a buffer): composer computes it
        elif isinstance(m, TensorStorageMetadata) and fqn.split(".")[0] in LOOP_STATE:
            small[fqn] = m
        elif isinstance(m, TensorStorageMetadata):
            tensors[fqn] = m
        elif isinstance(m, BytesStorageMetadata):
            objects.append(fqn)

    # Non-tensor entries: DCP's planner unpickles each into the state dict it loads.
    loaded = {k: io.BytesIO() for k in objects}
    if loaded:
        dcp.load(loaded, storage_reader=FileSystemReader(args.dcp), no_dist=True)
    manifest_objects = {}
    for k in objects:
        v = loaded[k]
        j = as_json(v)
        manifest_objects[k] = {"value": j} if j is not None or v is None else {"type": type(v).__name__,
                                                                              "repr": repr(v)[:200]}

    if small:
        t = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in small.items()}
        dcp.load(t, storage_reader=FileSystemReader(args.dcp), no_dist=True)
        for k, v in t.items():
            j = as_json(v)
            manifest_objects[k] = {"value": j} if j is not None else {"type": "tensor", "repr": f"shape {list(v.shape)}"}
    step = manifest_objects.pop("train_state.step", {}).get("value")
    if not isinstance(step, int) or step < 1:
        fail(f"{args.dcp} has no train_state.step of at least 1 (torchtitan's TrainState): composer resumes "
             "after a step the checkpoint names")

    # The tensors, whole, a parts file at a time (dcp.load reads every chunk each one overlaps).
    names = sorted(tensors)
    rules = RENAMES.get(args.model, [])
    renamed = {k: composer_name(k, rules) for k in names}
    files, batch, size = [], [], 0

    def flush():
        nonlocal batch, size
        if not batch:
            return
        sd = {k: torch.empty(tensors[k].size, dtype=tensors[k].properties.dtype) for k in batch}
        dcp.load(sd, storage_reader=FileSystemReader(args.dcp), no_dist=True)
        name = "parts-%05d.safetensors" % len(files)
        save_file({renamed[k]: v.contiguous() for k, v in sd.items()}, os.path.join(args.out, name))
        files.append(name)
        batch, size = [], 0

    for k in names:
        m = tensors[k]
        n = math.prod(m.size) * torch.empty((), dtype=m.properties.dtype).element_size()
        if batch and size + n > args.file_bytes:
            flush()
        batch.append(k)
        size += n
    flush()

    manifest = {"format": "composer-dcp-import", "source": os.path.abspath(args.dcp), "step": step, "files": files,
                "renamed": {k: v for k, v in renamed.items() if k != v},
                "tensors": [{"name": renamed[k], "dtype": str(tensors[k].properties.dtype).replace("torch.", ""),
                             "shape": list(tensors[k].size)} for k in names],
                "objects": manifest_objects, "computed": computed}
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"dcp_import: {args.dcp}: step {step}, {len(names)} tensors in {len(files)} files, "
          f"{len(manifest_objects)} other entries")


if __name__ == "__main__":
    main()

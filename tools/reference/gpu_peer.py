#!/usr/bin/env python3
"""PyTorch's side of tools/gpu-bench: trains a composer run's model on one GPU as a PyTorch user would.

    gpu_peer.py --run-dir RUN --timings OUT.jsonl [--compile] [--grouped-mm]

RUN is the directory of a composer run of a one-rank fully_shard config (config.resolved.json and
init.safetensors). The model is tools/reference/models.py's (attention through
F.scaled_dot_product_attention, PyTorch's fused kernels), given the run's initial weights, wrapped by
FSDP2's fully_shard with the run's mixed-precision policy (float32 parameters, param_dtype compute,
reduce_dtype gradients) over a one-rank NCCL group, and trained with torch.optim.AdamW (its default,
foreach) on the run's batches. --compile adds torch.compile; --grouped-mm runs a mixture of
experts' routed experts as torchtitan does (rows sorted by expert, one torch._grouped_mm per
projection) in place of the reference's loop over the experts. Each step is timed as composer times it
(from its start until the device has finished it) and written as a JSON line: step, loss, step_ms,
tokens_per_s and device_peak_allocated_mb (the caching allocator's peak during the step).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--timings", required=True)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--grouped-mm", action="store_true",
                    help="a mixture of experts' routed experts through torch._grouped_mm, as torchtitan runs them")
    ap.add_argument("--device", default="cuda", help="cuda (NCCL), or cpu (Gloo) to try the script without a GPU")
    args = ap.parse_args()

    cfg = reference.load_config(args.run_dir)
    if cfg["model"]["name"] not in ("llama", "transformer"):
        sys.exit(f"gpu_peer: model {cfg['model']['name']}: only llama and transformer are benchmarked")
    fs = [t["fully_shard"] for t in cfg.get("parallelize", []) if "fully_shard" in t]
    if len(fs) != 1 or not fs[0].get("param_dtype"):
        sys.exit("gpu_peer: the run must be one fully_shard with a param_dtype (the mixed-precision policy)")
    dtypes = reference.DTYPES
    mp = MixedPrecisionPolicy(param_dtype=dtypes[fs[0]["param_dtype"]],
                              reduce_dtype=dtypes[fs[0].get("reduce_dtype") or fs[0]["param_dtype"]])

    torch.backends.cuda.matmul.allow_tf32 = False  # as composer runs (its float32 work rounds as float32)
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        model = reference.build_model(cfg, args.run_dir, "gpu_peer").to(device)
        for m in model.modules():
            if hasattr(m, "grouped"):
                m.grouped = args.grouped_mm
        for block in model.layers.values():
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        step_fn = torch.compile(model) if args.compile else model
        o = cfg["train"]["optimizer"]
        if o["name"] != "adamw":
            sys.exit(f"gpu_peer: optimizer {o['name']}: the benchmark uses adamw")
        opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                weight_decay=o["weight_decay"])
        data = reference.Data(cfg, torch.float32)
        t = cfg["train"]
        batch = t["global_batch"]
        with open(args.timings, "w") as out:
            for step in range(1, t["steps"] + 1):
                x, y = data.batch(step, 0, batch)
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = reference.loss_fn(t["loss"], step_fn(x), y, batch, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync()
                ms = (time.perf_counter() - start) * 1e3
                rec = {"step": step, "loss": loss.item(), "step_ms": ms,
                       "tokens_per_s": x.numel() / (ms / 1e3),
                       "device_peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0}
                out.write(json.dumps(rec) + "\n")
                out.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

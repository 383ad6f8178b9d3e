#!/usr/bin/env python3
"""The golden of a mixture-of-experts plan (docs/scenarios.md 5.7, model M13), made by the seed's own
reference: one PyTorch model per data-parallel rank, each with its own expert (built right after
torch.manual_seed(42 + rank), as the seed builds it) and the shared parameters composer's run starts
from. Every rank trains on its part of the global batch; the non-expert gradients are averaged over the
ranks by hand (the seed's grad /= world; all_reduce(sum)) and the expert gradients stay local.

Each rank's backward runs on world x its share of the global-batch loss, composer's data-parallel
convention (averaging then gives the global loss's gradient; with a mean loss this is each rank's own
mean loss, as in the seed). The golden holds per step the global-batch loss and the gradient norm over
the shared gradients and every rank's expert gradient, and the final parameters, every expert stacked
over the ranks ([ranks, ...], as composer gathers a per-rank parameter).

composer runs the config as it is once, for the resolved config and rank 0's initial weights; rank 0's
expert there must equal the reference's (composer's per_rank_seed draws it). A golden that moves too
little for the config's tolerances is refused.

    tools/reference/moe_golden.py --config configs/parity/fsdp_mixture_of_experts_dp2.yaml --golden g.json
"""
import math
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mixed_golden  # noqa: E402
import models  # noqa: E402
import reference  # noqa: E402

ROOT = mixed_golden.ROOT


def per_rank_transform(cfg):
    """The data-parallel transform with per_rank, which must span the whole mesh (every rank its own expert)."""
    for t in cfg["parallelize"]:
        for kind, opts in t.items():
            if opts.get("per_rank"):
                world = math.prod(cfg["mesh"]["shape"])
                if len(opts["mesh_dim"]) != len(cfg["mesh"]["shape"]):
                    sys.exit("moe_golden: per_rank spans %s, not the whole mesh %s" % (opts["mesh_dim"],
                                                                                      cfg["mesh"]["names"]))
                return kind, opts, world
    sys.exit("moe_golden: no transform of the config has per_rank parameters")


def rank_models(cfg, run_dir, world):
    """One model per rank: its own expert, every other parameter from composer's initial weights."""
    init = reference.read_safetensors(os.path.join(run_dir, "init.safetensors"))
    dtype = reference.DTYPES[cfg["train"]["dtype"]]
    out = []
    for r in range(world):
        m = models.MixtureOfExperts(rank=r)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if not getattr(p, "expert", False):
                    p.copy_(init[n])
                elif r == 0 and not torch.equal(p, init[n]):
                    sys.exit("moe_golden: composer's rank-0 %s is not PyTorch's under seed 42 (max diff %.3g); "
                             "check per_rank_seed: 42" % (n, (p - init[n]).abs().max().item()))
        for p in m.parameters():
            p.data = p.data.to(dtype)
        m.train()
        out.append(m)
    return out


def train(cfg, ranks, world):
    t = cfg["train"]
    data = reference.Data(cfg, reference.DTYPES[t["dtype"]])
    opts = [reference.make_optimizer(t["optimizer"], list(m.parameters())) for m in ranks]
    scheds = [reference.make_scheduler(o, t["optimizer"], t["lr_schedule"], t["steps"]) for o in opts]
    named = [dict(m.named_parameters()) for m in ranks]
    experts = [n for n, p in named[0].items() if getattr(p, "expert", False)]
    B, M = t["global_batch"], t["microbatches"]
    local = B // world
    mb = local // M
    records = []
    for step in range(1, t["steps"] + 1):
        lr = opts[0].param_groups[0]["lr"]
        total = 0.0
        for r, m in enumerate(ranks):
            opts[r].zero_grad(set_to_none=True)
            for k in range(M):
                begin = r * local + k * mb
                x, y = data.batch(step, begin, begin + mb)
                loss = reference.loss_fn(t["loss"], m(x), y, mb, B)
                (loss * world).backward()
                total += loss.item()
        with torch.no_grad():
            for n in named[0]:
                if n in experts:
                    continue  # local
                avg = sum(nm[n].grad / world for nm in named)
                for nm in named:
                    nm[n].grad = avg.clone()
            sq = sum(p.grad.double().pow(2).sum().item() for n, p in named[0].items() if n not in experts)
            sq += sum(nm[n].grad.double().pow(2).sum().item() for nm in named for n in experts)
            norm = math.sqrt(sq)
            if t["grad_clip"] > 0:
                coef = min(1.0, t["grad_clip"] / (norm + 1e-6))
                for nm in named:
                    for p in nm.values():
                        p.grad.mul_(coef)
        for o, s in zip(opts, scheds):
            o.step()
            s.step()
        records.append({"step": step, "loss": total, "grad_norm": norm, "lr": lr})
        print(f"moe reference step {step}/{t['steps']} loss {total:.6g} grad_norm {norm:.4g}")
    final = []
    for n, p in named[0].items():
        if n in experts:
            final.append((n, torch.stack([nm[n].detach() for nm in named])))
        else:
            if not all(torch.equal(nm[n], p) for nm in named):
                sys.exit("moe_golden: shared parameter %s differs across the ranks" % n)
            final.append((n, p.detach()))
    return records, final


def main():
    given, composer, config, cfg, golden, work = mixed_golden.golden_cli(
        __doc__, "a parity config with a mixture_of_experts per_rank plan", "composer's run")
    if cfg["model"]["name"] != "mixture_of_experts":
        sys.exit("moe_golden: %s trains %s; this reference is the mixture of experts'" % (given, cfg["model"]["name"]))
    _, _, world = per_rank_transform(cfg)
    run_dir = os.path.join(work, "run")
    for d in (work, os.path.dirname(golden)):
        os.makedirs(d or ".", exist_ok=True)
    subprocess.run([composer, "run", "--config", config, "--out", run_dir, "--set", "checkpoint.resume=never"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    cfg = reference.load_config(run_dir)
    torch.set_num_threads(1)
    records, final = train(cfg, rank_models(cfg, run_dir, world), world)
    command = "tools/reference/moe_golden.py --config " + os.path.relpath(config, ROOT)
    reference.write_golden(golden, cfg, records, final, "pytorch-reference", command, {}, who="moe_golden")
    moved, change = mixed_golden.movement(golden, os.path.join(run_dir, "init.safetensors"))
    why = mixed_golden.too_little(moved, change, cfg["check"]["loss_rtol"], cfg["check"]["param_atol"])
    if why:
        sys.exit("moe_golden: the golden of %s: %s" % (given, why))


if __name__ == "__main__":
    main()

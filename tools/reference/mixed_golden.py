#!/usr/bin/env python3
"""The single-device golden of a mixed-precision plan, made now by the PyTorch reference under the
plan's own rounding policy.

composer runs the config on one device (parallelize and mesh dropped: the config hash covers seed,
model, train and data only, so the golden fits the parallel plan) to write the initial weights and
the resolved config; reference.py trains from them with the plan's fully_shard policy
(--param-dtype/--reduce-dtype, or --all-gather for the bfloat16 all-gather extension). A golden
that moves too little for the config's tolerances to tell a wrong run from a right one is refused:
some parameter must move by >= 8 x param_atol over the run, and (with more than one step) some
step's loss must differ from the previous one by >= 5 x loss_rtol (relative).

    tools/reference/mixed_golden.py --config configs/parity/fsdp_bf16_transformer_dp2.yaml
    build/composer check --config configs/parity/fsdp_bf16_transformer_dp2.yaml

writes the golden where the config's check.golden points (build/golden/...), or to --golden.
"""
import argparse
import base64
import json
import os
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARAM_MOVES = 8  # the least parameter movement, in param_atol
LOSS_MOVES = 5   # the least step-to-step loss change, in loss_rtol


def resolved(composer, config, sets=()):
    """The resolved config (`composer plan --json`'s "config")."""
    args = [composer, "plan", "--json", "--config", config] + [a for s in sets for a in ("--set", s)]
    out = subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out)["config"]


def policy_args(cfg):
    """reference.py's options for the rounding policy of the config's fully_shard, [] for none."""
    for t in cfg["parallelize"]:
        fs = t.get("fully_shard")
        if not fs:
            continue
        if fs["param_dtype"]:
            return ["--param-dtype", fs["param_dtype"], "--reduce-dtype", fs["reduce_dtype"] or fs["param_dtype"]]
        if fs["all_gather"] == "bfloat16":
            return ["--all-gather", "bfloat16"]
    return []


def read_f32_safetensors(path):
    """name -> flat list of floats, for the float32 tensors of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    out = {}
    for name, e in json.loads(raw[8:8 + n]).items():
        if name != "__metadata__" and e["dtype"] == "F32":
            begin, end = e["data_offsets"]
            out[name] = list(struct.unpack("<%df" % ((end - begin) // 4), raw[8 + n + begin:8 + n + end]))
    return out


def movement(golden_path, init_path):
    """(the largest parameter movement over the run, the largest relative loss change between steps, None
    for a one-step run)."""
    with open(golden_path) as f:
        golden = json.load(f)
    init = read_f32_safetensors(init_path)
    moved = 0.0
    for p in golden["params"]:
        raw = base64.b64decode(p["float64_base64"])
        final = struct.unpack("<%dd" % (len(raw) // 8), raw)
        moved = max([moved] + [abs(a - b) for a, b in zip(final, init[p["name"]])])
    losses = [s["loss"] for s in golden["steps"]]
    change = max((abs(b - a) / abs(a) for a, b in zip(losses, losses[1:])), default=None)
    return moved, change


def too_little(moved, change, loss_rtol, param_atol):
    """Why a golden that moves this much cannot catch a wrong run under these tolerances, or None."""
    if moved < PARAM_MOVES * param_atol or (change is not None and change < LOSS_MOVES * loss_rtol):
        return ("parameters move by at most %.2e (need %d x param_atol %.2e) and losses by %s relative per step "
                "(need %d x loss_rtol %.2e): too little for the tolerances to catch a wrong run; raise the learning "
                "rate" % (moved, PARAM_MOVES, param_atol, "%.2e" % change if change is not None else "(one step)",
                          LOSS_MOVES, loss_rtol))
    return None


def make(composer, config, work, golden, policy, sets=()):
    """Trains `config` on one device with composer (weights and resolved config, into work/single) and then
    with the PyTorch reference under `policy` (reference.py options) into `golden`."""
    for d in (work, os.path.dirname(golden)):
        os.makedirs(d or ".", exist_ok=True)
    run_dir = os.path.join(work, "single")
    single = ["parallelize=[]", "mesh.shape=[]", "mesh.names=[]"]
    # Always trains afresh: a folder left by an earlier run would otherwise be resumed (checkpoint.resume: auto).
    args = [composer, "run", "--config", config, "--out", run_dir, "--set", "checkpoint.resume=never"]
    subprocess.run(args + [a for s in list(sets) + single for a in ("--set", s)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    python = os.environ.get("PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
    subprocess.run([python, os.path.join(ROOT, "tools", "reference", "reference.py"), "--run-dir", run_dir,
                    "--golden", golden] + policy, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def golden_cli(description, config_help, work_help):
    """The command line of a golden maker (--config, --golden, --work, --composer): the config as given, the
    composer binary, the config's absolute path, its resolved form, the golden path and the work folder."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help=config_help)
    ap.add_argument("--golden", help="golden file to write (default: the config's check.golden)")
    ap.add_argument("--work", help="folder for %s (default: build/reference/<name>)" % work_help)
    ap.add_argument("--composer", default=os.path.join(ROOT, "build", "composer"))
    args = ap.parse_args()
    composer, config = os.path.abspath(args.composer), os.path.abspath(args.config)
    cfg = resolved(composer, config)
    # composer resolves the config's relative paths against the repository root, where it runs.
    golden = os.path.abspath(args.golden) if args.golden else os.path.join(ROOT, cfg["check"]["golden"])
    work = os.path.abspath(args.work) if args.work else os.path.join(ROOT, "build", "reference", cfg["name"])
    return args.config, composer, config, cfg, golden, work


def main():
    given, composer, config, cfg, golden, work = golden_cli(
        __doc__, "a parity config whose fully_shard rounds (param_dtype, all_gather)", "the single-device run")
    policy = policy_args(cfg)
    if not policy:
        sys.exit("mixed_golden: %s rounds nothing (no fully_shard param_dtype or bfloat16 all_gather); its golden "
                 "is a float32 one (tools/reference/regenerate)" % given)
    make(composer, config, work, golden, policy)
    moved, change = movement(golden, os.path.join(work, "single", "init.safetensors"))
    why = too_little(moved, change, cfg["check"]["loss_rtol"], cfg["check"]["param_atol"])
    if why:
        sys.exit("mixed_golden: the golden of %s (%s): %s" % (given, " ".join(policy), why))
    print("mixed_golden: %s (PyTorch reference, %s): parameters move up to %.2e, losses by up to %s relative per "
          "step" % (golden, " ".join(policy), moved, "%.2e" % change if change is not None else "(one step)"))


if __name__ == "__main__":
    main()

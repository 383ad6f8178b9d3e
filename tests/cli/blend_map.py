#!/usr/bin/env python3
"""A blended run's sample-to-source map, against tools/reference/blend.py (written from the documented
functions, not from composer's code): for the first N global samples of CONFIG, `composer plan --json
--samples N` gives each sample's file, window start and the documents its inputs meet; all three must
equal blend.py's, and the per-source shares must sit within 4 standard deviations of the weights.
Usage: blend_map.py COMPOSER CONFIG [N]"""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
import blend  # noqa: E402


def main():
    composer, cfg = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 10000
    out = subprocess.run([composer, "plan", "--json", "--samples", str(n), "--config", cfg], capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"FAIL: composer plan exited {out.returncode}: {out.stderr[-2000:]}")
    plan = json.loads(out.stdout)
    d, seed = plan["config"]["data"], plan["config"]["seed"]
    sources = d["sources"]
    weights = [s["weight"] for s in sources]
    width = 2 if d["token_dtype"] == "uint16" else 4
    files = []
    for s in sources:
        with open(os.path.join(ROOT, s["path"]), "rb") as f:
            raw = f.read()
        files.append([int.from_bytes(raw[i:i + width], "little") for i in range(0, len(raw), width)])
    docs = d.get("documents")
    ends = None
    if docs and docs["eos_id"] < 0:
        ends = []
        for s in sources:
            with open(os.path.join(ROOT, s["path"] + ".docs"), "rb") as f:
                raw = f.read()
            ends.append([int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)])
    seq = d["seq_len"] or plan["config"]["model"]["args"]["max_seq_len"]
    span = seq + 1
    samples = plan["samples"]
    if len(samples) != n:
        sys.exit(f"FAIL: composer gave {len(samples)} samples, not {n}")
    counts = [0] * len(sources)
    bad = 0
    for w in samples:
        g = w["index"]
        src = blend.blend_source(seed, g, weights)
        start = blend.token_window(seed, g, len(files[src]) - span + 1)
        want = {"source": src, "start": start, "path": sources[src]["path"]}
        if docs:
            row = (blend.doc_start_index(ends[src], start, span) if ends is not None
                   else blend.doc_start_eos(files[src][start:start + span], docs["eos_id"]))
            want["documents"] = sum(1 for k in range(seq) if row[k] == k)
        got = {k: w[k] for k in want}
        if got != want:
            bad += 1
            if bad <= 5:
                print(f"sample {g}: composer {got}, blend.py {want}")
        counts[src] += 1
    if bad:
        sys.exit(f"FAIL: {bad} of {n} samples differ")
    total = sum(weights)
    for i, c in enumerate(counts):
        p = weights[i] / total
        sigma = math.sqrt(n * p * (1 - p))
        print(f"source {i} ({sources[i]['path']}): {c} samples ({100 * c / n:.2f}%), weight {p:.3f}, "
              f"{(c - n * p) / sigma:+.2f} sigma")
        if abs(c - n * p) > 4 * sigma:
            sys.exit(f"FAIL: source {i}'s share is {(c - n * p) / sigma:+.1f} standard deviations off its weight")
    print(f"ok: {n} samples: every source, window start and document count equals blend.py's")


if __name__ == "__main__":
    main()

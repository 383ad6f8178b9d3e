#!/usr/bin/env python3
"""A run's metrics.jsonl as the lines composer writes to tools/track.py's stdin.

    trackers_feed.py METRICS_JSONL [--end STATUS] [--repeat N]

Prints each metrics.jsonl line as {"step": N, "scalars": [[tag, value], ...]} with TensorBoard's
tags (as composer's scalars_of makes them: every number by its key, a numeric object's members as
key/name, a numeric array's elements as key/index, booleans and the step left out), then
{"end": STATUS} unless STATUS is "none". --repeat N prints the lines N times over with the steps
counted on (a longer input from a short run).
"""
import argparse
import json
import sys


def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalars_of(line):
    out = []
    for key, v in line.items():
        if key == "step":
            continue
        if number(v):
            out.append([key, v])
        elif isinstance(v, dict):
            out += [[f"{key}/{name}", x] for name, x in v.items() if number(x)]
        elif isinstance(v, list):
            out += [[f"{key}/{i}", x] for i, x in enumerate(v) if number(x)]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("metrics")
    p.add_argument("--end", default="FINISHED")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    lines = [json.loads(l) for l in open(args.metrics) if l.strip()]
    last = lines[-1]["step"] if lines else 0
    for r in range(args.repeat):
        for line in lines:
            print(json.dumps({"step": line["step"] + r * last, "scalars": scalars_of(line)}))
    if args.end != "none":
        print(json.dumps({"end": args.end}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

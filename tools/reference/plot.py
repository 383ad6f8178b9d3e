#!/usr/bin/env python3
"""Pictures of composer runs, as PNG files (matplotlib).

    tools/plot loss RUN [--golden FILE] [--out PNG]
        the run's loss per step against its golden (config.resolved.json's check.golden unless
        --golden), with the relative error |run - golden| / |golden| on a second, logarithmic axis
    tools/plot runs RUN [RUN ...] [--metric loss] [--out PNG]
        several runs' metric per step on one chart (for example every plan of one model)
    tools/plot schedule RUN [--out PNG]
        the last step of a pipeline run as a Gantt chart per rank (timeline.rank<R>.json): forward
        (F), backward (B), input-gradient (I) and weight-gradient (W) actions, idle time in grey,
        with the measured bubble beside the schedule's formula (metrics.jsonl)

RUN is a run's output folder (composer run --out). Each command prints what it drew; the PNG goes to
--out, by default RUN/loss.png, runs.png (beside the first run) or RUN/schedule.png.
"""
import argparse
import glob
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def fail(msg):
    print(f"plot: {msg}", file=sys.stderr)
    sys.exit(2)


def metrics(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"{run}: no metrics.jsonl; give the output folder of a composer run")
    return [json.loads(line) for line in open(path) if line.strip()]


def resolved(run):
    path = os.path.join(run, "config.resolved.json")
    return json.load(open(path)) if os.path.isfile(path) else {}


def plot_loss(a):
    steps = metrics(a.run)
    golden_path = a.golden or resolved(a.run).get("check", {}).get("golden")
    if not golden_path or not os.path.isfile(golden_path):
        fail(f"{a.run}: no golden file ({golden_path or 'none named'}); give --golden FILE")
    golden = {s["step"]: s["loss"] for s in json.load(open(golden_path))["steps"]}
    xs = [s["step"] for s in steps]
    common = [s for s in steps if s["step"] in golden]
    if not common:
        fail(f"{a.run}: no step in common with {golden_path}")
    errs = [abs(s["loss"] - golden[s["step"]]) / max(abs(golden[s["step"]]), 1e-30) for s in common]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, [s["loss"] for s in steps], "o-", label="run", color="#4c72b0")
    ax.plot(sorted(golden), [golden[k] for k in sorted(golden)], "x--", label="golden (one device)", color="black")
    evals = [(s["step"], s["eval_loss"]) for s in steps if "eval_loss" in s]
    if evals:
        ax.plot(*zip(*evals), "s-", label="eval loss", color="#55a868")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2 = ax.twinx()
    ax2.semilogy([s["step"] for s in common], [max(e, 1e-17) for e in errs], ".:", color="#c44e52",
                 label="relative error")
    ax2.set_ylabel("relative error (log)", color="#c44e52")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper right")
    name = resolved(a.run).get("name", os.path.basename(os.path.normpath(a.run)))
    ax.set_title(f"{name}: loss against {os.path.basename(golden_path)}")
    out = a.out or os.path.join(a.run, "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"{out}: {len(steps)} steps, {len(common)} against the golden, "
          f"largest relative error {max(errs):.3g} at step {common[errs.index(max(errs))]['step']}")


def plot_runs(a):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = []
    for run in a.runs:
        steps = [s for s in metrics(run) if a.metric in s]
        if not steps:
            fail(f"{run}: metrics.jsonl has no {a.metric}")
        label = os.path.basename(os.path.normpath(run))
        ax.plot([s["step"] for s in steps], [s[a.metric] for s in steps], ".-", label=label)
        drawn.append((label, steps[-1][a.metric]))
    ax.set_xlabel("step")
    ax.set_ylabel(a.metric)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.legend(fontsize="small", ncol=2 if len(a.runs) > 8 else 1)
    ax.set_title(f"{a.metric} of {len(a.runs)} runs")
    out = a.out or os.path.join(os.path.dirname(os.path.normpath(a.runs[0])) or ".", "runs.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    last = ", ".join(f"{n} {v:.6g}" for n, v in drawn)
    print(f"{out}: {len(drawn)} runs; last {a.metric}: {last}")


def plot_schedule(a):
    files = sorted(glob.glob(os.path.join(a.run, "timeline.rank*.json")),
                   key=lambda p: int(re.search(r"rank(\d+)", p).group(1)))
    if not files:
        fail(f"{a.run}: no timeline.rank<R>.json; only pipeline runs write them")
    ranks = []
    for f in files:  # Chrome traces: each action an "X" event, times in microseconds
        t = json.load(open(f))
        actions = [{"action": e["name"], "start_ms": e["ts"] / 1e3, "end_ms": (e["ts"] + e["dur"]) / 1e3}
                   for e in t["traceEvents"] if e.get("ph") == "X"]
        ranks.append({"rank": t["rank"], "stages": t["stages"], "timeline": actions})
    end = max(e["end_ms"] for r in ranks for e in r["timeline"])
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.6 * len(ranks)))
    busy = []
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        ax.broken_barh([(0, end)], (y - 0.4, 0.8), color="#dddddd")
        spans = [(e["start_ms"], e["end_ms"] - e["start_ms"]) for e in r["timeline"]]
        colours = [COLOURS.get(e["action"][0], "#8172b2") for e in r["timeline"]]
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=colours, edgecolor="white", linewidth=0.3)
        for e in r["timeline"]:
            if e["end_ms"] - e["start_ms"] > end / 60:
                ax.text((e["start_ms"] + e["end_ms"]) / 2, y, e["action"], ha="center", va="center", fontsize=6,
                        color="white")
        busy.append(sum(d for _, d in spans))
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r['rank']} (stages {r['stages']})" for r in reversed(ranks)])
    ax.set_xlabel("ms since the step's start on each rank")
    last = metrics(a.run)[-1]
    measured, formula = last.get("pipeline_bubble"), last.get("pipeline_bubble_formula")
    schedule = next((t["pipeline"].get("schedule") for t in resolved(a.run).get("parallelize", [])
                     if "pipeline" in t), "pipeline")
    title = f"{schedule}, step {last['step']}"
    if measured is not None:
        title += f": bubble {measured:.1%} measured, {formula:.1%} by the formula"
    ax.set_title(title)
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles.append(matplotlib.patches.Patch(color="#dddddd", label="idle"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    out = a.out or os.path.join(a.run, "schedule.png")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    idle = [1 - b / end for b in busy]
    print(f"{out}: {len(ranks)} ranks over {end:.1f} ms; idle per rank "
          + ", ".join(f"{i:.1%}" for i in idle)
          + (f"; bubble measured {measured:.1%}, formula {formula:.1%}" if measured is not None else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("loss", help="a run's loss against its golden")
    p.add_argument("run")
    p.add_argument("--golden")
    p.add_argument("--out")
    p.set_defaults(fn=plot_loss)
    p = sub.add_parser("runs", help="several runs on one chart")
    p.add_argument("runs", nargs="+")
    p.add_argument("--metric", default="loss")
    p.add_argument("--out")
    p.set_defaults(fn=plot_runs)
    p = sub.add_parser("schedule", help="a pipeline step as a Gantt chart per rank")
    p.add_argument("run")
    p.add_argument("--out")
    p.set_defaults(fn=plot_schedule)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Checks the directions composer's includes may take (docs/architecture.md).

Folders are layered: a file may include files of its own folder and of the
folders below it, never above. Two files (a header and its source count as one
unit) never include each other, directly or through a cycle of units.
Exits 1 and names each offending include.
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# Lowest first. Each may include itself and what comes before it.
LAYERS = [
    "models",
    "parallelisms/comm",
    "parallelisms",
    "runner/base",
    "runner/config",
    "runner/observe",
    "runner/plan",
    "runner/launch",
    "runner/checkpoint",
    "runner/train",
    "runner/estimate",
    "runner/verify",
    "runner/suggest",
    "runner/cli",
    "runner",
]
# Exceptions to the order above: (folder, folder it may not include) pairs
# that the order would allow but the design forbids.
FORBIDDEN = [
    ("runner/base", "models"),
    ("runner/base", "parallelisms"),
    # The planner is pure: it shows nothing of a run.
    ("runner/plan", "runner/observe"),
]
SOURCE_DIRS = ["models", "parallelisms", "runner"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(path):
    folder = os.path.dirname(path)
    best = None
    for name in LAYERS:
        if folder == name or folder.startswith(name + "/"):
            if best is None or len(name) > len(best):
                best = name
    return best


def unit_of(path):
    return os.path.splitext(path)[0]


def sources():
    for top in SOURCE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".h", ".cpp")):
                    yield os.path.relpath(os.path.join(dirpath, f), ROOT)


def main():
    problems = []
    edges = {}
    for path in sorted(sources()):
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        here = layer_of(path)
        for inc in INCLUDE.findall(text):
            if not os.path.exists(os.path.join(ROOT, inc)):
                if inc.split("/")[0] in SOURCE_DIRS:
                    problems.append(f"{path}: includes {inc}, which does not exist")
                continue
            there = layer_of(inc)
            if here is None or there is None:
                continue
            if LAYERS.index(there) > LAYERS.index(here):
                problems.append(f"{path}: {here}/ may not include {inc} ({there}/ is above it)")
            for a, b in FORBIDDEN:
                if (here == a or here.startswith(a + "/")) and (there == b or there.startswith(b + "/")):
                    problems.append(f"{path}: {a}/ may not include {inc} ({b}/)")
            if unit_of(inc) != unit_of(path):
                edges.setdefault(unit_of(path), set()).add(unit_of(inc))
    # Cycles between units (a header and its source are one unit).
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                cycle = stack[stack.index(v):] + [v]
                problems.append("include cycle: " + " -> ".join(cycle))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u)
    for p in problems:
        print(p)
    units = len({unit_of(p) for p in sources()})
    print(f"layout: {units} units, {sum(len(v) for v in edges.values())} include edges, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# profile: {steps: [2, 3]} on fully_shard dp 2: each rank writes a Chrome trace
# of the profiled steps that Python's json reads; both steps are annotated, the
# step's matrix products lie inside them, the prefetched all-gather's ring runs
# on a thread of its own (its sends and receives are recorded there, not only on
# the training thread), and tools/trace-overlap measures communication and
# compute in it. Rank 0's merged trace.json has a process per rank, events that
# nest on every thread, every collective of the last step with its group and
# bytes summing to comm.rank<R>.json's, and a prefetched all-gather running
# while the training thread runs the previous unit's forward.
# Usage: profile_trace.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
rm -rf "$work"
"$composer" run --config configs/bench/fsdp_dp2.yaml --out "$work/run" --set checkpoint.resume=never \
  --set train.steps=3 --set profile.steps=[2,3] --set profile.dir="$work/trace" >"$work.log" 2>&1 ||
  { cat "$work.log"; exit 1; }
grep -q "profile: steps 2-3 traced in $work/trace/trace.json (every rank)" "$work.log"
! grep -q ERROR "$work.log"  # a cpu run logs nothing from the profiler's GPU probe
tools/trace-overlap "$work/trace" --json "$work/overlap.json"
exec /usr/bin/python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
ok = True
for rank in (0, 1):
    events = [e for e in json.load(open(f"{work}/trace/kineto.rank{rank}.json"))["traceEvents"] if e.get("ph") == "X"]
    steps = {e["name"]: e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step ")}
    main = steps["step 2"]["tid"] if "step 2" in steps else None
    inside = lambda e, s: s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]  # noqa: E731
    mms = [e for e in events if e["name"] in ("aten::mm", "aten::addmm")]
    in_steps = {n: sum(inside(e, s) for e in mms) for n, s in steps.items()}
    ring_threads = {e["tid"] for e in events if e["name"] in ("gloo:send", "gloo:recv")} - {main}
    print(f"rank {rank}: annotations {sorted(steps)}, matrix products per step {in_steps}, "
          f"threads other than the training thread with sends and receives: {len(ring_threads)}")
    ok &= sorted(steps) == ["step 2", "step 3"] and all(n > 0 for n in in_steps.values()) and len(ring_threads) >= 1
figures = json.load(open(f"{work}/overlap.json"))
print("communication ms", [r["comm_ms"] for r in figures], "compute ms", [r["compute_ms"] for r in figures])
ok &= len(figures) == 2 and all(r["comm_ms"] > 0 and r["compute_ms"] > 0 for r in figures)

merged = json.load(open(f"{work}/trace/trace.json"))["traceEvents"]
names = {e["pid"]: e["args"]["name"] for e in merged if e.get("ph") == "M" and e["name"] == "process_name"}
print("processes", names)
ok &= names.get(0) == "rank 0" and names.get(2) == "rank 1"
rows = {}
for e in merged:
    if e.get("ph") == "X":
        rows.setdefault((e["pid"], e["tid"]), []).append(e)
bad = 0
for evs in rows.values():  # on one thread, an event starting inside another ends inside it
    stack = []
    for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        if stack and e["ts"] + e["dur"] > stack[-1] + 1.0:  # 1 us: the trace's rounding
            bad += 1
        stack.append(e["ts"] + e["dur"])
print(f"threads {len(rows)}, events that cross their parent's end: {bad}")
ok &= bad == 0
for rank in (0, 1):
    pid = 2 * rank
    last = next(e for e in merged if e["pid"] == pid and e.get("name") == "step 3")
    within = lambda e: last["ts"] <= e["ts"] <= last["ts"] + last["dur"]  # noqa: E731
    got = {}
    for e in merged:
        if e["pid"] == pid and e.get("cat") == "collective" and within(e):
            key = (e["args"]["group"], e["args"]["kind"])
            got[key] = got.get(key, 0) + e["args"]["bytes"]
    want = {(g, k): b for g, kinds in json.load(open(f"{work}/run/comm.rank{rank}.json"))["bytes"].items()
            for k, b in kinds.items() if b}
    print(f"rank {rank}: the last step's collectives in the trace {got}; comm.rank{rank}.json {want}")
    ok &= got == want
    forwards = [e for e in merged if e["pid"] == pid and e.get("name", "").startswith("forward ") and within(e)]
    gathers = [e for e in merged if e["pid"] == pid and e.get("cat") == "collective" and e["args"]["kind"] == "all_gather"
               and within(e) and e["tid"] != last["tid"]]
    overlapping = [(g["name"], f["name"]) for g in gathers for f in forwards
                   if g["ts"] < f["ts"] + f["dur"] and f["ts"] < g["ts"] + g["dur"]]
    print(f"rank {rank}: all-gathers on another thread overlapping a unit's forward: {overlapping[:3]}")
    ok &= len(overlapping) > 0
sys.exit(0 if ok else 1)
PY

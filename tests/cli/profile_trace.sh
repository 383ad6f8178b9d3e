#!/usr/bin/env bash
# profile: {steps: [2, 3]} on fully_shard dp 2: each rank writes a Chrome trace
# of the profiled steps that Python's json reads; both steps are annotated, the
# step's matrix products lie inside them, the prefetched all-gather's ring runs
# on a thread of its own (its sends and receives are recorded there, not only on
# the training thread), and tools/trace-overlap measures communication and
# compute in it. Usage: profile_trace.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
rm -rf "$work"
"$composer" run --config configs/bench/fsdp_dp2.yaml --out "$work/run" --set checkpoint.resume=never \
  --set train.steps=3 --set profile.steps=[2,3] --set profile.dir="$work/trace" >"$work.log" 2>&1 ||
  { cat "$work.log"; exit 1; }
grep -q "profile: steps 2-3 traced in $work/trace/kineto.rank0.json" "$work.log"
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
sys.exit(0 if ok else 1)
PY

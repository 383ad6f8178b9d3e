#!/usr/bin/env bash
# composer diff names the first divergence of a plan from one device: with a
# fault injected (debug.inject by FQN, grad_x2, microbatch_off_by_one) it must
# exit 1 and its first divergence must be exactly the expected tensor, and with
# none it must exit 0 and find none.
# Usage: diff_localise.sh COMPOSER CONFIG WORK EXPECT [ARGS...]
#   EXPECT: match, or KIND:MODULE:MICROBATCH:RANKS of the first divergence
#   (KIND output or input_grad; RANKS comma-joined), e.g. output:layers.0.attention.wo:0:1
#   ARGS: more arguments for composer diff (--set debug.inject=..., --step N)
set -u
composer=$1 cfg=$2 work=$3 expect=$4
shift 4
mkdir -p "$work"
"$composer" diff --config "$cfg" --out "$work" --json "$@" > "$work/diff.out" 2>&1
code=$?
python3 - "$expect" "$code" "$work/diff.out" <<'PY'
import json, sys
expect, code = sys.argv[1], int(sys.argv[2])
g = lambda v: "not finite" if v is None else "%.3g" % v  # JSON has no inf: the report writes null
out = open(sys.argv[3]).read()
try:
    report = json.loads(out[out.index("{"):])
except ValueError:
    print("FAIL: no JSON report (exit %d):\n%s" % (code, out[-2000:]))
    sys.exit(1)
first = report["first"]
if expect == "match":
    if code == 0 and first is None and report["diverging"] == 0 and report["compared"] > 0:
        w = report["worst"]
        print("ok: %d tensors match at step %d; worst %s %s rel err %s (tolerance %.3g)" %
              (report["compared"], report["step"], w["module"], w["kind"], g(w["rel_err"]), report["rtol"]))
        sys.exit(0)
    print("FAIL: expected a match, got exit %d, first %s" % (code, json.dumps(first)))
    sys.exit(1)
kind, module, mb, ranks = expect.split(":")
got = None if first is None else "%s:%s:%d:%s" % (first["kind"], first["module"], first["microbatch"],
                                                  ",".join(str(r) for r in first["ranks"]))
if code == 1 and got == expect:
    print("ok: step %d, %s: %s %s, max abs err %s, rel err %s, on ranks %s (%s); %d of %d tensors diverge" %
          (report["step"], first["direction"], first["module"], first["tensor"], g(first["max_abs_err"]),
           g(first["rel_err"]), first["ranks"], first["where"], report["diverging"], report["compared"]))
    sys.exit(0)
print("FAIL: expected first divergence %s, got %s (exit %d)" % (expect, got, code))
for d in report.get("divergences", [])[:5]:
    print("  %s %s mb %d ranks %s rel %s" % (d["kind"], d["module"], d["microbatch"], d["ranks"], g(d["rel_err"])))
sys.exit(1)
PY

# Helpers for the checkpoint tests (sourced): runs, and comparisons of two
# runs' outputs.
fail() { echo "FAIL: $*"; exit 1; }

# run OUT_DIR CONFIG [--set ...]: composer run, its log in OUT_DIR.log; fails the test on error.
run() {
  local out=$1 cfg=$2
  shift 2
  "$composer" run --config "$cfg" --out "$out" "$@" >"$out.log" 2>&1 || fail "$cfg $*: $(tail -3 "$out.log")"
}

# same_run A B FIRST_STEP: A's and B's final parameters equal byte for byte,
# and their losses from step FIRST_STEP on are equal bit for bit.
same_run() {
  cmp -s "$1/final.safetensors" "$2/final.safetensors" || fail "$2's final parameters differ from $1's"
  /usr/bin/python3 - "$1/metrics.jsonl" "$2/metrics.jsonl" "$3" <<'PY' || fail "$2's losses differ from $1's"
import json, sys
a, b = ({r["step"]: r["loss"] for r in map(json.loads, open(p))} for p in sys.argv[1:3])
steps = [s for s in a if s >= int(sys.argv[3])]
sys.exit(0 if steps and all(s in b and repr(a[s]) == repr(b[s]) for s in steps) else 1)
PY
}

# close_run REFERENCE B FIRST_STEP: B's final parameters and its losses from
# FIRST_STEP on are within the tolerances of B's config (check.param_atol and
# param_rtol, loss_atol and loss_rtol: those of its golden check) of REFERENCE's.
close_run() {
  /usr/bin/python3 - "$1" "$2" "$3" <<'PY' || fail "$2 is not within its tolerances of $1"
import json, struct, sys
def tensors(p):
    raw = open(p, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]; h = json.loads(raw[8:8 + n]); d = raw[8 + n:]
    return {k: struct.unpack("<%df" % ((v["data_offsets"][1] - v["data_offsets"][0]) // 4), d[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in h.items() if k != "__metadata__"}
ref, run, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
chk = json.load(open(run + "/config.resolved.json"))["check"]
a, b = tensors(ref + "/final.safetensors"), tensors(run + "/final.safetensors")
assert a.keys() == b.keys(), (sorted(a), sorted(b))
worst = max(abs(x - y) - chk["param_atol"] - chk["param_rtol"] * abs(x) for k in a for x, y in zip(a[k], b[k]))
la, lb = ({r["step"]: r["loss"] for r in map(json.loads, open(p + "/metrics.jsonl"))} for p in (ref, run))
steps = [s for s in la if s >= first]
lworst = max(abs(la[s] - lb[s]) - chk["loss_atol"] - chk["loss_rtol"] * abs(la[s]) for s in steps)
dp = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
dl = max(abs(la[s] - lb[s]) for s in steps)
print("max parameter difference %.3g, max loss difference %.3g over steps %s" % (dp, dl, steps))
sys.exit(0 if worst <= 0 and lworst <= 0 else 1)
PY
}

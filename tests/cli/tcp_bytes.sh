#!/usr/bin/env bash
# metrics.jsonl's tcp_tx_bytes is what the logging rank's sockets really
# sent: for a 2-rank replicate run it covers the ring all-reduce's bytes
# (comm_ring_bytes) every step, plus at most a little protocol overhead.
# Usage: tcp_bytes.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
"$composer" run --config configs/parity/replicate_transformer_dp2.yaml --out "$work/run" >"$work/log" 2>&1 ||
  { cat "$work/log"; echo "FAIL: the run failed"; exit 1; }
exec /usr/bin/python3 - "$work/run/metrics.jsonl" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
bad = [s for s in steps if not ("tcp_tx_bytes" in s and
       s["comm_ring_bytes"] <= s["tcp_tx_bytes"] <= 1.02 * s["comm_ring_bytes"] + 65536)]
for s in bad:
    print("FAIL: step %d sent %s bytes for %d ring bytes" % (s["step"], s.get("tcp_tx_bytes"), s["comm_ring_bytes"]))
if bad or not steps:
    sys.exit(1)
print("ok: %d steps; sent %d bytes for %d ring bytes at step 1" % (len(steps), steps[0]["tcp_tx_bytes"],
                                                                  steps[0]["comm_ring_bytes"]))
PY

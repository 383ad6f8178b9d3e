#!/usr/bin/env bash
# The flight recorder names the rank and the operation a hang is about:
#  1. rank 1 leaves out its first gradient reduction of step 2
#     (debug.inject: skip_collective) under fully_shard: the job fails and
#     the launcher reports a mismatch naming both ranks, the sequence number
#     and both operations' kinds, and every rank's dump is written;
#  2. rank 0 of a pipeline stops before its first send (a delay longer than
#     the timeout): rank 1 times out in the receive, and the launcher names
#     rank 0 as behind on that send.
# Usage: flight_recorder.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }

start=$SECONDS
"$composer" run --config configs/parity/fsdp_transformer_dp2.yaml --out "$work/skip" --set checkpoint.resume=never \
  --set mesh.timeout_s=5 --set debug.inject=skip_collective --set debug.inject_rank=1 --set debug.inject_step=2 \
  >"$work/skip.log" 2>&1 && fail "a rank that skipped a collective did not fail the job"
took=$((SECONDS - start))
line=$(grep -m1 "^flight recorder: mismatch on " "$work/skip.log") ||
  fail "no mismatch reported: $(grep 'flight recorder' "$work/skip.log" | head -3)"
echo "$line" | grep -Eq "at collective #[0-9]+: rank 0 issued [a-z_]+ \(.*\), rank 1 issued [a-z_]+ \(" ||
  fail "the mismatch does not name both ranks, the number and both kinds: $line"
for r in 0 1; do
  /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["rank"]==int(sys.argv[2]) and d["operations"]' \
    "$work/skip/flight/rank-$r.json" "$r" || fail "rank $r's dump is missing or empty"
done
echo "ok: skipped collective (${took} s to the report): ${line#flight recorder: }"

start=$SECONDS
"$composer" run --config configs/parity/pp2_1f1b_transformer.yaml --out "$work/send" --set checkpoint.resume=never \
  --set mesh.timeout_s=5 --set 'debug.delay=[{point: before_send, ms: 600000, ranks: [0]}]' \
  >"$work/send.log" 2>&1 && fail "a rank stopped before its send did not fail the job"
took=$((SECONDS - start))
line=$(grep -m1 "^flight recorder: rank 0 is behind on pp\[0,1\]: rank 1 waits in recv #1 from it" "$work/send.log") ||
  fail "rank 0 is not named behind on its send: $(grep 'flight recorder' "$work/send.log" | head -3)"
echo "$line" | grep -q "which it has not issued; its last send to rank 1 is #0" || fail "the operation is not named: $line"
echo "ok: a rank stopped in a pipeline send (${took} s to the report): ${line#flight recorder: }"

#!/usr/bin/env bash
# Two composer invocations (--nnodes 2, 2 ranks each) form one 4-rank job on
# loopback and pass the replicate dp4 parity check. Then rank 3 is made to
# fail: its error must come out of node 1 (which hosts ranks 2 and 3), and
# node 0 must stop too instead of hanging. Usage: two_nodes.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
cfg=configs/parity/replicate_mlp_module_dp4.yaml

# Runs both nodes of one job on a fresh port ($1: the name of their logs and
# outputs, the rest: extra arguments); sets $code0 and $code1.
run_nodes() {
  local name=$1 port
  shift
  port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
  local common=(check --config "$cfg" --nnodes 2 --master-port "$port" "$@")
  timeout 120 "$composer" "${common[@]}" --node-rank 1 --out "$work/${name}1" >"$work/${name}1.log" 2>&1 &
  local other=$!
  timeout 120 "$composer" "${common[@]}" --node-rank 0 --out "$work/${name}0" >"$work/${name}0.log" 2>&1
  code0=$?
  wait $other
  code1=$?
  cat "$work/${name}0.log" "$work/${name}1.log"
}

run_nodes node
[ $code0 -eq 0 ] && [ $code1 -eq 0 ] || { echo "FAIL: node exit codes $code0 and $code1"; exit 1; }
grep -q "\[rank 0/4\] check passed" "$work/node0.log" || { echo "FAIL: node 0 did not pass the check"; exit 1; }
grep -q "^\[rank [23]/4\]" "$work/node0.log" && { echo "FAIL: node 0 printed lines of ranks 2 or 3"; exit 1; }
echo "ok: 2 nodes x 2 ranks passed"

start=$(date +%s)
run_nodes fail --set debug.fail_rank=3 --set debug.fail_step=2
elapsed=$(( $(date +%s) - start ))
grep -q "^\[rank 3/4\] runtime failure: injected failure at step 2" "$work/fail1.log" ||
  { echo "FAIL: rank 3's error did not come out of node 1"; exit 1; }
grep -q "^rank 3 failed with exit code 3" "$work/fail1.log" || { echo "FAIL: node 1 did not name rank 3"; exit 1; }
[ $code1 -eq 3 ] || { echo "FAIL: node 1 exit code $code1, expected 3"; exit 1; }
[ $code0 -eq 3 ] || { echo "FAIL: node 0 exit code $code0, expected 3 (124 = it hung)"; exit 1; }
echo "ok: rank 3 failed on node 1; both nodes stopped with exit 3 in ${elapsed}s"

#!/usr/bin/env bash
# Two composer invocations (--nnodes 2, 2 ranks each) form one 4-rank job on
# loopback and pass the replicate dp4 parity check. Usage: two_nodes.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
cfg=configs/parity/replicate_mlp_module_dp4.yaml
common=(check --config "$cfg" --nnodes 2 --master-port "$port")
timeout 120 "$composer" "${common[@]}" --node-rank 1 --out "$work/node1" >"$work/node1.log" 2>&1 &
other=$!
timeout 120 "$composer" "${common[@]}" --node-rank 0 --out "$work/node0" >"$work/node0.log" 2>&1
code0=$?
wait $other
code1=$?
cat "$work/node0.log" "$work/node1.log"
[ $code0 -eq 0 ] && [ $code1 -eq 0 ] || { echo "FAIL: node exit codes $code0 and $code1"; exit 1; }
grep -q "\[rank 0/4\] check passed" "$work/node0.log" || { echo "FAIL: node 0 did not pass the check"; exit 1; }
grep -q "^\[rank 3/4\]" "$work/node1.log" && echo "FAIL: node 1 should host ranks 2 and 3 only, and print no metrics" && exit 1
echo "ok: 2 nodes x 2 ranks passed"

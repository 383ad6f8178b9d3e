#!/usr/bin/env bash
# Under a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT) each composer process runs as that one rank; rank
# 0 hosts the store. Then: a peer that dies makes the survivor fail, not hang.
# Usage: external_launcher.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
cfg=configs/parity/replicate_mlp_module_dp2.yaml
run_rank() {  # rank, extra args...
  local r=$1
  shift
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout 90 "$composer" check --config "$cfg" --out "$work/r$r" "$@" >"$work/rank$r.log" 2>&1
}
port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
run_rank 1 & other=$!
run_rank 0; code0=$?
wait $other; code1=$?
cat "$work/rank0.log"
[ $code0 -eq 0 ] && [ $code1 -eq 0 ] || { echo "FAIL: exit codes $code0, $code1"; cat "$work/rank1.log"; exit 1; }
grep -q "\[rank 0/2\] check passed" "$work/rank0.log" || { echo "FAIL: rank 0 did not pass"; exit 1; }

# Rank 1 dies at step 2; rank 0 must notice the dead peer and exit non-zero.
port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
start=$(date +%s)
run_rank 1 --set debug.fail_rank=1 --set debug.fail_step=2 & other=$!
run_rank 0 --set debug.fail_rank=1 --set debug.fail_step=2; code0=$?
wait $other; code1=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/rank0.log" "$work/rank1.log"
[ $code1 -eq 3 ] || { echo "FAIL: the failing rank exited $code1"; exit 1; }
[ $code0 -eq 3 ] || { echo "FAIL: the surviving rank exited $code0, expected 3"; exit 1; }
[ $elapsed -le 60 ] || { echo "FAIL: the survivor took ${elapsed}s"; exit 1; }
echo "ok: external launch passed; a dead peer stopped the survivor in ${elapsed}s"

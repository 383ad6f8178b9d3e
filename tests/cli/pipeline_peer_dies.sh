#!/usr/bin/env bash
# A pipeline whose peer dies stops, never hangs: two ranks under a
# torchrun-style environment run a 1f1b pipeline; the last stage's rank dies
# at step 2 and the first stage's rank, waiting for a gradient from it, must
# exit 3 well within mesh.timeout_s.
# Usage: pipeline_peer_dies.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
cfg=configs/parity/pp2_1f1b_transformer.yaml
port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
run_rank() {  # rank
  RANK=$1 WORLD_SIZE=2 LOCAL_RANK=$1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout 120 "$composer" run --config "$cfg" --out "$work/r$1" --set train.steps=100 --set mesh.timeout_s=60 \
    --set debug.fail_rank=1 --set debug.fail_step=2 >"$work/rank$1.log" 2>&1
}
start=$(date +%s)
run_rank 1 & other=$!
run_rank 0; code0=$?
wait $other; code1=$?
elapsed=$(( $(date +%s) - start ))
cat "$work/rank0.log" "$work/rank1.log"
[ $code1 -eq 3 ] || { echo "FAIL: the failing rank exited $code1"; exit 1; }
[ $code0 -eq 3 ] || { echo "FAIL: the surviving stage exited $code0, expected 3"; exit 1; }
[ $elapsed -le 50 ] || { echo "FAIL: the surviving stage took ${elapsed}s"; exit 1; }
echo "ok: a dead pipeline peer stopped the other stage in ${elapsed}s"

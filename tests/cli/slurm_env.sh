#!/usr/bin/env bash
# Under SLURM's srun each task runs as one rank from SLURM_PROCID, SLURM_NTASKS,
# SLURM_LOCALID, SLURM_NNODES and the first host of SLURM_JOB_NODELIST (here
# "127.0.0.[1-4]", bracket syntax, so the rendezvous is on loopback): two tasks
# started that way train the plan and pass its check, and their weights equal
# those of the same plan under composer's own launcher.
# Usage: slurm_env.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
cfg=configs/parity/replicate_mlp_module_dp2.yaml
port=$(/usr/bin/python3 "$(dirname "$0")/free_port.py")
task() {  # procid
  SLURM_PROCID=$1 SLURM_NTASKS=2 SLURM_LOCALID=$1 SLURM_NNODES=1 SLURM_NODEID=0 \
    SLURM_JOB_NODELIST='127.0.0.[1-4]' MASTER_PORT=$port \
    timeout 90 "$composer" check --config "$cfg" --out "$work/slurm" >"$work/task$1.log" 2>&1
}
task 1 & other=$!
task 0; code0=$?
wait $other; code1=$?
[ $code0 -eq 0 ] && [ $code1 -eq 0 ] || { echo "FAIL: exit codes $code0, $code1"; cat "$work/task0.log" "$work/task1.log"; exit 1; }
grep -q "\[rank 0/2\] check passed" "$work/task0.log" || { echo "FAIL: task 0 did not pass"; cat "$work/task0.log"; exit 1; }
"$composer" check --config "$cfg" --out "$work/local" >/dev/null 2>&1 || { echo "FAIL: the local launch failed"; exit 1; }
cmp -s "$work/slurm/final.safetensors" "$work/local/final.safetensors" ||
  { echo "FAIL: the srun-style tasks end elsewhere than composer's launcher"; exit 1; }
echo "ok: two srun-style tasks (SLURM_* variables, nodelist 127.0.0.[1-4]) trained the plan as composer's launcher does"

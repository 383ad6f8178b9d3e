#!/usr/bin/env bash
# Trains configs on the GPU (mesh.device cuda) and checks each against its
# golden, the check the config names (ctest label gpu). Exits 77 (ctest: skipped)
# where no GPU is visible or this build has no CUDA library. Usage:
#   gpu_runs.sh COMPOSER OUT_DIR [--set KEY=VALUE ...] -- CONFIG...
# The --set options apply to every config (mesh.backend=gloo lets several
# ranks share the one GPU; NCCL refuses two ranks on one GPU).
set -u
composer=$1 out=$2
shift 2
sets=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  sets+=("$1")
  shift
done
shift
probe=$("$composer" plan --config tests/cli/cuda_device.yaml --set mesh.shape=[1] 2>&1 >/dev/null)
if [ $? -ne 0 ]; then
  echo "skipped: no GPU to train on: $probe"
  exit 77
fi
# The GPU sums in another order than the CPU that trained the goldens (cuBLAS's
# blocking): float32 losses and gradient norms still agree to about 1e-7, but
# Adam magnifies the order's noise in near-zero gradients, so parameters may
# drift by a few 1e-6 (param_atol at least 1e-5); bfloat16 runs round apart
# by a unit of bfloat16 (u = 2^-8) per step, compounding over the steps:
# losses and gradient norms within 4u, parameters within 2u (two units in the
# last place at magnitude 1). docs/gpu.md gives the measurements.
gpu_tolerance() {  # CONFIG -> --set options
  local atol
  if grep -q '^[^#]*dtype: *bfloat16' "$1"; then
    echo --set check.loss_rtol=1.5625e-2 --set check.param_rtol=7.8125e-3 --set check.param_atol=7.8125e-3
    return
  fi
  atol=$(grep -o 'param_atol: *[0-9.eE+-]*' "$1" | head -1 | sed 's/.*: *//')
  if [ -z "$atol" ] || awk -v a="$atol" 'BEGIN { exit !(a < 1e-5) }'; then echo --set check.param_atol=1e-5; fi
}
mkdir -p "$out"
failed=0
for cfg in "$@"; do
  name=$(basename "$cfg" .yaml)
  # shellcheck disable=SC2046 # the options are words
  if "$composer" check --config "$cfg" --out "$out/$name" --set mesh.device=cuda --set checkpoint.resume=never \
      "${sets[@]}" $(gpu_tolerance "$cfg") >"$out/$name.log" 2>&1; then
    echo "ok: $name: $(grep -o 'max loss rel err.*' "$out/$name.log" | head -1)"
  else
    echo "FAIL: $name (log: $out/$name.log)"
    tail -5 "$out/$name.log"
    failed=1
  fi
done
exit $failed

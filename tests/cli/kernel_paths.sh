#!/usr/bin/env bash
# Goldens hold on any x86 CPU: a sample of golden checks runs again under the
# other kernel paths this CPU can take, as another machine would run them:
# ATen's vectorised kernels at each capability (ATEN_CPU_CAPABILITY avx2,
# avx512 where the CPU has it; default below) and MKL's code paths (MKL_CBWR
# COMPATIBLE, AVX2). A golden whose check holds only on the instruction set it
# was written with fails here. Each check prints how much of its tolerance
# its worst error used; the table at the end lists them.
# Usage: kernel_paths.sh COMPOSER WORK_DIR [CONFIG...]
set -u
composer=$1 work=$2
shift 2
rm -rf "$work" && mkdir -p "$work"
configs=("$@")
if [ ${#configs[@]} -eq 0 ]; then
  # The checks most exposed to kernel paths: Adam with its eps raised, AdamW (the Transformer's plans
  # check against it), SGD on Llama (nearest its tolerance), bfloat16 and float64.
  configs=(configs/parity/composite_param_model.yaml configs/parity/transformer.yaml configs/parity/llama_sgd.yaml
    configs/parity/mlp_stack_17_sp.yaml configs/parity/simple_model_uneven.yaml)
fi
# ATEN_CPU_CAPABILITY=default is a CPU without AVX2. Its random fills (normal_, uniform_) draw
# values a few ulps from an AVX2 CPU's, PyTorch's own as well; a golden carries the initial weights
# it was trained from (x.init.safetensors) and composer check trains from them after measuring its
# own draw against them, so those ulps do not reach the training.
# KERNEL_PATHS="MKL_CBWR=AVX2 ..." runs the paths given instead.
flags=$(grep -m1 '^flags' /proc/cpuinfo)
paths=(MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default)
if [[ " $flags " == *" avx2 "* && " $flags " == *" fma "* ]]; then paths+=(ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2); fi
if [[ " $flags " == *" avx512f "* ]]; then paths+=(ATEN_CPU_CAPABILITY=avx512); fi
if [ -n "${KERNEL_PATHS:-}" ]; then read -r -a paths <<<"$KERNEL_PATHS"; fi

failed=0
report=()
for cfg in "${configs[@]}"; do
  name=$(basename "$cfg" .yaml)
  for path in "${paths[@]}"; do
    out=$work/$name.${path//=/_}
    if env "$path" "$composer" check --config "$cfg" --out "$out" >"$out.log" 2>&1; then
      used=$(grep -o 'worst error at [^ ]* of its tolerance' "$out.log" | tail -1 | cut -d' ' -f4)
      drawn=$(grep -o 'drawn within [^ ]*' "$out.log" | tail -1 | cut -d' ' -f3)
      report+=("$(printf '%-32s %-28s passed, worst error at %s of its tolerance, initial weights drawn within %s' \
        "$name" "$path" "$used" "${drawn:-(none drawn)}")")
    else
      failed=1
      report+=("$(printf '%-32s %-28s FAILED: %s' "$name" "$path" "$(grep -m1 'check failed\|error' "$out.log")")")
    fi
  done
done
printf '%s\n' "${report[@]}"
[ "$failed" = 0 ] || { echo "FAIL: a golden check does not hold under another CPU kernel path (logs in $work)"; exit 1; }
echo "ok: ${#configs[@]} golden checks hold under ${#paths[@]} other kernel paths"

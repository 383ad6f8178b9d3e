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
# ATEN_CPU_CAPABILITY=default (a CPU without AVX2) is not among the paths yet: there ATen's random
# fills (normal_, uniform_) draw other values than on any AVX2 CPU, PyTorch's own as well, and
# composer draws its initial weights exactly as PyTorch does (tools/reference/moe_golden.py checks
# that they are equal), so a golden written on an AVX2 machine starts from other weights there.
# KERNEL_PATHS="ATEN_CPU_CAPABILITY=default ..." runs the paths given instead.
flags=$(grep -m1 '^flags' /proc/cpuinfo)
paths=(MKL_CBWR=COMPATIBLE)
if [[ " $flags " == *" avx2 "* && " $flags " == *" fma "* ]]; then paths+=(ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2); fi
if [[ " $flags " == *" avx512f "* ]]; then paths+=(ATEN_CPU_CAPABILITY=avx512); fi
if [ -n "${KERNEL_PATHS:-}" ]; then read -r -a paths <<<"$KERNEL_PATHS"; fi

failed=0
report=()
failed_runs=()
for cfg in "${configs[@]}"; do
  name=$(basename "$cfg" .yaml)
  # A failing path whose initial weights differ from those under the CPU's widest path (run last)
  # did not train from the same start, and its line says so.
  last=$work/$name.${paths[-1]//=/_}
  for path in "${paths[@]}"; do
    out=$work/$name.${path//=/_}
    if env "$path" "$composer" check --config "$cfg" --out "$out" >"$out.log" 2>&1; then
      used=$(grep -o 'worst error at [^ ]* of its tolerance' "$out.log" | tail -1 | cut -d' ' -f4)
      report+=("$(printf '%-32s %-28s passed, worst error at %s of its tolerance' "$name" "$path" "$used")")
    else
      failed=1
      report+=("$(printf '%-32s %-28s FAILED: %s' "$name" "$path" "$(grep -m1 'check failed\|error' "$out.log")")")
      failed_runs+=("$out ${#report[@]}")
    fi
  done
  for f in "${failed_runs[@]}"; do
    read -r out line <<<"$f"
    if [ -f "$out/init.safetensors" ] && [ -f "$last/init.safetensors" ] && ! cmp -s "$out/init.safetensors" "$last/init.safetensors"; then
      report[line - 1]+=" (its initial weights differ from those under ${paths[-1]}: the random fills depend on the kernel path)"
    fi
  done
  failed_runs=()
done
printf '%s\n' "${report[@]}"
[ "$failed" = 0 ] || { echo "FAIL: a golden check does not hold under another CPU kernel path (logs in $work)"; exit 1; }
echo "ok: ${#configs[@]} golden checks hold under ${#paths[@]} other kernel paths"

#!/usr/bin/env bash
# A golden carries the initial weights it was trained from (x.init.safetensors); composer check draws
# its own as usual, measures them against the golden's and trains from the golden's. A drawn start
# beyond the rounding of another CPU's random fills (a changed initialisation) fails the check with
# exit 1, naming the tensor, on one device (a model built whole) and under tensor_parallel (each
# rank given only its piece); an init file without one of the model's tensors fails too.
# Usage: golden_init.sh COMPOSER PYTHON WORK_DIR
set -u
composer=$1 python=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }

# The golden, and its init file with output.weight moved by 1e-3 of itself (1e-5 is allowed).
cp tests/golden/llama_sgd.json "$work/moved.json"
"$python" - "$work" <<'PY' || fail "cannot write the moved init files"
import sys
from safetensors.torch import load_file, save_file
work = sys.argv[1]
t = load_file("tests/golden/llama_sgd.init.safetensors")
moved = dict(t)
moved["output.weight"] = t["output.weight"] * 1.001
save_file(moved, work + "/moved.init.safetensors", metadata={"format": "pt"})
short = {k: v for k, v in t.items() if k != "norm.weight"}
save_file(short, work + "/short.init.safetensors", metadata={"format": "pt"})
PY
cp tests/golden/llama_sgd.json "$work/short.json"

expect_fail() {  # NAME CONFIG GOLDEN REGEX
  local log=$work/$1.log
  "$composer" check --config "$2" --set check.golden="$3" --out "$work/$1" >"$log" 2>&1
  local rc=$?
  [ "$rc" = 1 ] || { cat "$log"; fail "$1: exit $rc, expected 1 (check failed)"; }
  grep -q "$4" "$log" || { cat "$log"; fail "$1: no line matching '$4'"; }
  echo "ok: $1 fails: $(grep -m1 -o "$4.*" "$log" | cut -c1-160)"
}
expect_fail single configs/parity/llama_sgd.yaml "$work/moved.json" \
  "initial weights drawn are not those the golden was trained from: output.weight element"
expect_fail tp2 configs/parity/tp_llama_lp_tp2.yaml "$work/moved.json" \
  "initial weights drawn are not those the golden was trained from: output.weight element"
expect_fail short configs/parity/llama_sgd.yaml "$work/short.json" "has no initial value for norm.weight"

# The golden's own init file: the draw is within the rounding (0 on a CPU with the kernels the golden's
# were drawn with), and the check passes.
out=$work/same.log
"$composer" check --config configs/parity/tp_llama_lp_tp2.yaml --out "$work/same" >"$out" 2>&1 || { cat "$out"; fail "the unmoved check failed"; }
grep -q "initial weights: drawn within .* trained from the golden.s" "$out" || { cat "$out"; fail "the unmoved check did not start from the golden's initial weights"; }
echo "ok: $(grep -o "initial weights: drawn within [^ ]*" "$out"), and the check passes"

#!/usr/bin/env bash
# Injected delays (debug.delay) must not change a run: the plan CONFIG is
# trained once as it is and once per DELAYS list (YAML, e.g.
# '[{point: after_loss, ms: 250, ranks: [1]}]'), with the same extra --set
# overrides; every delayed run must end bit for bit where the undelayed one
# ends (final.safetensors and every logged loss and gradient norm), and each
# delayed rank must report that it slept.
# Usage: delays.sh COMPOSER WORK_DIR CONFIG 'SET...' DELAYS...   (SET: space-separated path=value)
set -u
composer=$1 work=$2 cfg=$3 sets=$4
shift 4
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
args=()
for s in $sets; do args+=(--set "$s"); done
"$composer" run --config "$cfg" --out "$work/plain" "${args[@]}" >"$work/plain.log" 2>&1 ||
  fail "undelayed run: $(tail -3 "$work/plain.log")"
records() {
  /usr/bin/python3 -c 'import json,sys; print(" ".join("%d:%r:%r" % (j["step"], j["loss"], j["grad_norm"]) for j in map(json.loads, open(sys.argv[1]))))' "$1"
}
i=0
for delays in "$@"; do
  i=$((i + 1))
  out=$work/delayed$i
  "$composer" run --config "$cfg" --out "$out" "${args[@]}" --set "debug.delay=$delays" >"$out.log" 2>&1 ||
    fail "delayed run $delays: $(tail -3 "$out.log")"
  slept=$(grep -o 'debug.delay: slept [0-9]* times' "$out.log" | grep -o '[0-9]*' | sort -n | tr '\n' ' ')
  [ -n "$slept" ] && ! echo " $slept" | grep -q ' 0 ' || fail "$delays: a delayed rank never slept (sleeps per rank: $slept)"
  cmp -s "$work/plain/final.safetensors" "$out/final.safetensors" ||
    fail "$delays: final parameters differ from the undelayed run's"
  [ "$(records "$work/plain/metrics.jsonl")" = "$(records "$out/metrics.jsonl")" ] ||
    fail "$delays: losses differ: $(records "$work/plain/metrics.jsonl") vs $(records "$out/metrics.jsonl")"
  echo "ok: $delays: sleeps per delayed rank $slept; final parameters, losses and gradient norms equal bit for bit"
done

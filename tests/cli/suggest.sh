#!/usr/bin/env bash
# composer suggest on 4 ranks of a Llama whose config keeps 8 microbatches: the best plan and its
# runners-up are written, each plan passes `composer check` against the config's own golden (the
# search keeps train.microbatches, so the golden's hash holds), and the choice is explained in the
# file. Usage: suggest.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
rm -rf "$work"
mkdir -p "$work"
"$composer" suggest --config configs/parity/pp2_1f1b_llama.yaml --ranks-per-node 4 --top 3 \
  --matmul-tflops 0.05 --out "$work/suggested.yaml" | tee "$work/suggest.log"
grep -q "^# chosen, the cheapest that fits: " "$work/suggested.yaml"
grep -q "^# runner-up 2: " "$work/suggested.2.yaml"
grep -q "^  - " "$work/suggested.yaml"
for f in "$work"/suggested.yaml "$work"/suggested.2.yaml "$work"/suggested.3.yaml; do
  "$composer" check --config "$f" --out "$work/run_$(basename "$f" .yaml)" | grep "check passed"
done

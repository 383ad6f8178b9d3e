#!/usr/bin/env bash
# composer suggest on 4 ranks of a Llama whose config keeps 8 microbatches: the machine is probed
# (its rates cached in the work dir), the best plan and its runners-up are written with the reason
# the best wins, each plan passes `composer check` against the config's own golden (the search keeps
# train.microbatches, so the golden's hash holds), --json gives every candidate's terms, and
# --from-run prices a finished run's plan against its measured steps and refits the cached rates.
# Usage: suggest.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
rm -rf "$work"
mkdir -p "$work"
export COMPOSER_CACHE_DIR=$work/cache
"$composer" suggest --config configs/parity/pp2_1f1b_llama.yaml --ranks-per-node 4 --top 3 \
  --out "$work/suggested.yaml" | tee "$work/suggest.log"
grep -q "^rates (probed here in " "$work/suggest.log"
grep -q '"intra_by_size"' "$work/cache/machine.json"
grep -q "^# chosen, the cheapest that fits: " "$work/suggested.yaml"
grep -q "^# why: .* ms a step cheaper than " "$work/suggested.yaml"
grep -q "^# runner-up 2: " "$work/suggested.2.yaml"
grep -q "^  - " "$work/suggested.yaml"
for f in "$work"/suggested.yaml "$work"/suggested.2.yaml "$work"/suggested.3.yaml; do
  "$composer" check --config "$f" --out "$work/run_$(basename "$f" .yaml)" | grep "check passed"
done
# a second search reads the cache, and --json lists every candidate with its terms
"$composer" suggest --config configs/parity/pp2_1f1b_llama.yaml --ranks-per-node 4 --top 3 --json \
  --out "$work/again.yaml" > "$work/suggest.json"
python3 - "$work/suggest.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["rates_source"].startswith("cached in "), j["rates_source"]
assert len(j["fitting"]) == 3, len(j["fitting"])
every = j["fitting"] + j["over_memory"] + j["not_run_dry"]
assert len(every) == j["candidates"], (len(every), j["candidates"])
assert sum(bool(c["refused"]) for c in every) == j["refused"]
for c in every:
    terms = c["terms_ms"]
    assert abs(sum(terms.values()) - c["step_ms"]) < 1e-6 * c["step_ms"] + 1e-9, c
    assert terms["matmul"] > 0, c
print("suggest --json: %d candidates, each with its terms" % len(every))
PY
"$composer" suggest --from-run "$work/run_suggested" --config "$work/suggested.yaml" | tee "$work/from_run.log"
grep -q "^  step: measured [0-9.]* ms, predicted [0-9.]* ms" "$work/from_run.log"
grep -q "^  refit from 1 run(s): compute x" "$work/from_run.log"
python3 -c "
import json, sys
e = json.load(open('$work/cache/machine.json'))['entries']
assert any(v['runs_fitted'] == 1 for v in e.values()), e
"
# what the cost model counts is what tensor_parallel sends: for each style, the bytes of the run's
# collectives a step (its comm_ring_bytes) and their number, the gradient norm's all-reduce over every
# rank among them
for style in "" ", sequence_parallel: true" ", sequence_parallel: true, loss_parallel: true"; do
  cat > "$work/tp.yaml" <<EOF
name: suggest_tp_counts
seed: 0
model:
  name: llama
  args: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 4, vocab_size: 64, multiple_of: 32, max_seq_len: 32}
mesh: {shape: [4], names: [tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp$style}
train:
  steps: 3
  global_batch: 4
  optimizer: {name: sgd, lr: 0.1}
  loss: {name: cross_entropy}
data: {seq_len: 16}
EOF
  rm -rf "$work/run_tp"
  "$composer" run --config "$work/tp.yaml" --out "$work/run_tp" > /dev/null
  "$composer" suggest --from-run "$work/run_tp" --config "$work/tp.yaml" | tee "$work/from_run_tp.log"
  python3 - "$work/from_run_tp.log" "$style" <<'PY'
import re, sys
line = [l for l in open(sys.argv[1]) if l.startswith("  collectives a step: ")][0]
calls, sent, pcalls, psent = map(float, re.search(
    r"measured ([0-9.]+) calls sending ([0-9.]+) MB, priced ([0-9.]+) calls sending ([0-9.]+) MB", line).groups())
assert abs(psent - sent) <= 0.01 * sent, (sys.argv[2], line)
assert calls == pcalls, (sys.argv[2], line)
print("tensor_parallel {mesh_dim: tp%s}: %g calls and %g MB a step, as priced" % (sys.argv[2], pcalls, psent))
PY
done
echo "suggest: ok"

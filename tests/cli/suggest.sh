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
echo "suggest: ok"

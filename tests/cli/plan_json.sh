#!/usr/bin/env bash
# `composer plan --json` prints one JSON object: the resolved config, every
# parameter's placement and every rank's estimate, in exact bytes; the 3-D
# parity config's human summary stays under 90 lines. Usage: plan_json.sh COMPOSER
set -eu
composer=$1
"$composer" plan --json --config configs/quickstart.yaml | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)
assert j["config"]["train"]["global_batch"] == 16, j["config"]["train"]
assert [list(t)[0] for t in j["config"]["parallelize"]] == ["tensor_parallel", "fully_shard"]
assert len(j["placements"]) == 28, len(j["placements"])  # embeddings 2, 12 per layer, final norm 2 (output tied)
assert all(p["placement"] and p["gradient"] for p in j["placements"]), j["placements"]
ranks = [r["rank"] for r in j["ranks"]]
assert ranks == [0, 1, 2, 3], ranks
assert all(r["peak"] > r["params"] > 0 and r["comm"]["tp"] for r in j["ranks"]), j["ranks"]
print("ok: config, %d placements, %d ranks" % (len(j["placements"]), len(ranks)))
'
lines=$("$composer" plan --config configs/parity/tp2sp_fsdp2_pp2_1f1b_transformer_untied.yaml | wc -l)
[ "$lines" -lt 90 ] || { echo "FAIL: composer plan printed $lines lines for an 8-rank 3-D plan"; exit 1; }
echo "ok: the 8-rank 3-D plan's summary is $lines lines"

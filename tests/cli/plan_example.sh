#!/usr/bin/env bash
# `composer plan` of a planning example (configs/examples/): it plans without a
# GPU (mesh.memory_per_rank_mb stands for the GPUs' memory), and its memory
# table gives every rank of the world exactly once (ranks whose dry runs are
# provably the same share a row). Usage: plan_example.sh COMPOSER CONFIG [--set ...]
set -u
composer=$1 cfg=$2
shift 2
out=$("$composer" plan --config "$cfg" "$@" 2>&1) || { echo "FAIL: composer plan exited $?"; echo "$out"; exit 1; }
echo "$out" | /usr/bin/python3 -c '
import re, sys
text = sys.stdin.read()
world = int(re.search(r"world size (\d+)", text).group(1))
table = text.split("memory per rank (estimate):")[1].split("communication per rank")[0]
seen = []
for line in table.strip().splitlines()[1:]:
    ranks = re.split(r"\s{2,}", line.strip())[0]
    for part in ranks.split(", "):
        a, _, b = part.partition("-")
        seen += range(int(a), int(b or a) + 1)
if sorted(seen) != list(range(world)):
    sys.exit("FAIL: the memory table covers ranks %s, not 0-%d once each" % (sorted(set(seen))[:8], world - 1))
print("ok: %d ranks in %d rows" % (world, len(table.strip().splitlines()) - 1))
'

#!/usr/bin/env bash
# Real text in: a byte-level BPE tokenizer trained with the tokenizers library
# on the project's own docs, tools/prepare-data over the docs and a JSON-lines
# file, read back (every document's ids are the tokenizer's, each followed by
# <|endoftext|>, and the printed counts are the file's); a Llama under
# fully_shard dp 2 trains on the file and its loss falls; a vocab_size below the
# file's largest id is refused before launch (exit 2, naming both).
# Usage: prepare_data.sh COMPOSER WORK_DIR
set -eu
composer=$1 work=$2
python=${PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
rm -rf "$work" && mkdir -p "$work"
"$python" tools/reference/train_tokenizer.py --vocab 2048 --out "$work/tokenizer.json" docs/*.md README.md
printf '{"text": "composer trains what one device trains."}\n{"text": "Second document: a plan, then its check."}\n' \
  >"$work/extra.jsonl"
tools/prepare-data --tokenizer "$work/tokenizer.json" --out "$work/docs.bin" docs/*.md README.md "$work/extra.jsonl" |
  tee "$work/prepare.txt"
"$python" - "$work" docs/*.md README.md <<'PY'
import json, re, sys
import numpy as np
from tokenizers import Tokenizer
work, files = sys.argv[1], sys.argv[2:]
tok = Tokenizer.from_file(f"{work}/tokenizer.json")
eos = tok.token_to_id("<|endoftext|>")
texts = [open(f, encoding="utf-8").read() for f in files]
texts += [json.loads(l)["text"] for l in open(f"{work}/extra.jsonl")]
ids = np.fromfile(f"{work}/docs.bin", dtype="<u2")
docs = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
want = np.concatenate([np.asarray(d) for d in docs])
ends = np.cumsum([len(d) for d in docs]) - 1  # where each document's end-of-text id must be
said = re.search(r"(\d+) documents, (\d+) tokens .* (\d+) bytes as uint16", open(f"{work}/prepare.txt").read())
same = np.array_equal(ids, want)
closed = same and bool((ids[ends] == eos).all())
print(f"documents {len(texts)}, tokens {len(ids)} (the tokenizer's: {same}), every document followed by "
      f"<|endoftext|>: {closed}, printed {said.groups()}")
ok = same and closed
ok &= said.groups() == (str(len(texts)), str(len(ids)), str(2 * len(ids)))
sys.exit(0 if ok else 1)
PY
common=(--config configs/parity/llama.yaml --set data.source=tokens --set data.path="$work/docs.bin"
  --set data.token_dtype=uint16 --set data.seq_len=32 --set train.steps=20 --set train.lr_schedule.decay=none
  --set train.optimizer.lr=3.0e-3 --set train.loss.scale=1.0 --set train.global_batch=8
  --set "mesh={shape: [2], names: [dp]}" --set "parallelize=[{fully_shard: {mesh_dim: dp}}]")
"$composer" run "${common[@]}" --set model.args.vocab_size=2048 --out "$work/run" --set checkpoint.enabled=false \
  >"$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
"$python" - "$work/run/metrics.jsonl" <<'PY'
import json, math, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1])]
first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
print(f"losses {[round(x, 4) for x in losses]}; mean of the first three {first:.4f}, of the last three {last:.4f}")
sys.exit(0 if all(math.isfinite(x) for x in losses) and last < first else 1)
PY
set +e
"$composer" plan "${common[@]}" --set model.args.vocab_size=1000 >"$work/small.log" 2>&1
rc=$?
set -e
cat "$work/small.log"
[ $rc -eq 2 ] && grep -q "largest token id is [0-9]* (token [0-9]*), not below the model's vocab_size 1000" "$work/small.log"

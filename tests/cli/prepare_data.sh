#!/usr/bin/env bash
# Real text in: a byte-level BPE tokenizer trained with the tokenizers library
# on the project's own docs, tools/prepare-data over the docs and a JSON-lines
# file, read back (every document's ids are the tokenizer's, each followed by
# <|endoftext|>, and the printed counts are the file's); a folder of .md, .txt,
# .jsonl and .parquet files (and a file of another kind, skipped), with a
# document long enough to be tokenised in pieces, read back the same way with
# its document index (OUT.docs), and the same bytes from 1 and 2 workers; bad
# input (a line that is not JSON, a missing column, a file of another kind
# named, a missing file) stops it with exit 2 and the place, leaving no output;
# a Llama under fully_shard dp 2 trains on the file and its loss falls; a
# vocab_size below the file's largest id is refused before launch (exit 2,
# naming both).
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
# A folder: files in the sorted order of their paths, whatever the workers.
corpus=$work/corpus
mkdir -p "$corpus/a" "$corpus/b"
cp README.md "$corpus/a/readme.md"
cp docs/configuration.md "$corpus/b/z.txt"
printf '{"text": "first line"}\n\n{"text": "holds <|endoftext|> in its text", "id": 7}\n{"text": ""}\n' \
  >"$corpus/b/lines.jsonl"
cat docs/*.md docs/*.md >"$corpus/long.txt"
echo "a,b" >"$corpus/notes.csv"
"$python" - "$corpus" <<'PY'
import sys
import pyarrow as pa, pyarrow.parquet as pq
rows = ["row one", "row two: " + open("docs/launching.md").read()[:2000], "row three", "", "row five"]
pq.write_table(pa.table({"id": list(range(5)), "text": rows}), f"{sys.argv[1]}/b/rows.parquet", row_group_size=2)
PY
for w in 1 2; do
  tools/prepare-data --tokenizer "$work/tokenizer.json" --out "$work/folder$w.bin" --workers $w --chunk-docs 2 \
    "$corpus" >"$work/folder$w.txt" 2>"$work/folder$w.err"
done
cat "$work/folder2.txt" "$work/folder2.err"
cmp "$work/folder1.bin" "$work/folder2.bin" && cmp "$work/folder1.bin.docs" "$work/folder2.bin.docs"
grep -q "^prepare-data: $corpus: 5 files to read, 1 skipped" "$work/folder2.err"
"$python" - "$work" "$corpus" <<'PY'
import json, re, sys
import numpy as np
import pyarrow.parquet as pq
from tokenizers import Tokenizer
sys.path.insert(0, "tools/reference")
import prepare_data
work, corpus = sys.argv[1:]
tok = Tokenizer.from_file(f"{work}/tokenizer.json")
eos = tok.token_to_id("<|endoftext|>")
texts = [open(f"{corpus}/a/readme.md", encoding="utf-8").read()]
texts += [json.loads(l)["text"] for l in open(f"{corpus}/b/lines.jsonl") if l.strip()]
texts += pq.read_table(f"{corpus}/b/rows.parquet").column("text").to_pylist()
texts += [open(f"{corpus}/{f}", encoding="utf-8").read() for f in ("b/z.txt", "long.txt")]
# The long document is tokenised in pieces; its ids must still be the whole text's.
cut = prepare_data.cuttable(json.load(open(f"{work}/tokenizer.json"))) and len(prepare_data.pieces(texts[-1])) > 1
docs = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
ids = np.fromfile(f"{work}/folder1.bin", dtype="<u2")
ends = np.fromfile(f"{work}/folder1.bin.docs", dtype="<u8")
same = np.array_equal(ids, np.concatenate([np.asarray(d) for d in docs]))
index = np.array_equal(ends, np.cumsum([len(d) for d in docs]))
closed = len(ends) == len(texts) and ends[-1] == len(ids) and bool((ids[ends.astype(np.int64) - 1] == eos).all())
said = re.search(r"(\d+) documents, (\d+) tokens .* (\d+) bytes as uint16", open(f"{work}/folder1.txt").read())
inner = sum(eos in d[:-1] for d in docs)  # documents whose text holds <|endoftext|> (these docs, a .jsonl line)
held = f"documents holding <|endoftext|> in their text: {inner} " in open(f"{work}/folder1.txt").read()
print(f"folder: documents {len(texts)}, tokens {len(ids)} (the tokenizer's: {same}), index {len(ends)} ends "
      f"(the documents': {index}, last = token count and each document closed by <|endoftext|>: {closed}), "
      f"long document cut: {cut}, printed {said.groups()}, {inner} holding <|endoftext|> counted: {held}")
ok = same and index and closed and cut and held
ok &= said.groups() == (str(len(texts)), str(len(ids)), str(2 * len(ids)))
sys.exit(0 if ok else 1)
PY
# Bad input: exit 2, the file (and line) named, no traceback, nothing left at OUT.
mkdir -p "$work/bad"
printf '{"text": "fine"}\n{"text": oops}\n' >"$work/bad/bad.jsonl"
bad() {
  local want=$1
  shift
  set +e
  tools/prepare-data --tokenizer "$work/tokenizer.json" --out "$work/bad/out.bin" "$@" >"$work/bad/log" 2>&1
  local rc=$?
  set -e
  cat "$work/bad/log"
  [ $rc -eq 2 ] && grep -q "^prepare-data: $want" "$work/bad/log" && ! grep -q Traceback "$work/bad/log" &&
    [ -z "$(ls "$work/bad" | grep '^out\.bin')" ] || { echo "bad input $*: exit $rc"; exit 1; }
}
bad "$work/bad/bad.jsonl:2: not JSON" "$work/bad/bad.jsonl"
bad "$corpus/b/rows.parquet: no column \"body\"" --text-field body "$corpus/b/rows.parquet"
bad "$corpus/notes.csv: not a .txt, .md, .jsonl or .parquet file" "$corpus/notes.csv"
bad "$work/bad/none.txt: no such file or folder" "$work/bad/none.txt"
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

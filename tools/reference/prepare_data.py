#!/usr/bin/env python3
"""Text to composer's token file, with a Hugging Face tokenizer (the tokenizers library).

    tools/prepare-data --tokenizer tokenizer.json --out corpus.bin FILE [FILE ...]
    tools/prepare-data --tokenizer tokenizer.json --out corpus.bin --eos "<|end_of_text|>" docs/*.jsonl

Each .txt or .md file is one document; each line of a .jsonl file is one document, its "text" field.
Every document's ids are followed by the end-of-text id (--eos TOKEN names it; by default the
tokenizer's first special token among <|endoftext|>, <|end_of_text|>, </s>, <eos>, [SEP]). The ids
are written as little-endian uint16 when the vocabulary has at most 65536 entries, else uint32, one
after another: composer's data: {source: tokens, path: OUT, token_dtype: ...}. Prints documents,
tokens and bytes, and the data section to use. Any tokenizer.json works, for example a Hugging Face
model folder's (Llama 3's has 128256 entries, so uint32); a model's vocab_size must exceed every id.
"""
import argparse
import json
import os
import sys

import numpy as np
from tokenizers import Tokenizer

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


def documents(paths):
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        sys.exit(f"prepare-data: {path}:{n}: not a JSON object with a \"text\" field ({e})")
                    yield text
        else:
            with open(path, encoding="utf-8") as f:
                yield f.read()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    ap.add_argument("--out", required=True, help="the token file to write")
    ap.add_argument("--eos", help="the end-of-text token appended after every document")
    ap.add_argument("files", nargs="+", help=".txt/.md files (a document each) or .jsonl files (a document per line)")
    a = ap.parse_args()
    for p in a.files + [a.tokenizer]:
        if not os.path.isfile(p):
            sys.exit(f"prepare-data: {p}: no such file")
    tok = Tokenizer.from_file(a.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    names = [a.eos] if a.eos else [n for n in EOS_NAMES if tok.token_to_id(n) is not None][:1]
    if not names or tok.token_to_id(names[0]) is None:
        sys.exit(f"prepare-data: {a.tokenizer} has no end-of-text token "
                 f"{'named ' + a.eos if a.eos else 'among ' + ', '.join(EOS_NAMES)}; name one with --eos")
    eos = tok.token_to_id(names[0])
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    docs = tokens = 0
    tmp = a.out + ".tmp"
    with open(tmp, "wb") as f:
        batch = []
        for text in documents(a.files):
            batch.append(text)
            if len(batch) == 256:
                for enc in tok.encode_batch(batch, add_special_tokens=False):
                    ids = np.asarray(enc.ids + [eos], dtype=dtype)
                    f.write(ids.astype(ids.dtype.newbyteorder("<")).tobytes())
                    docs += 1
                    tokens += len(ids)
                batch = []
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            ids = np.asarray(enc.ids + [eos], dtype=dtype)
            f.write(ids.astype(ids.dtype.newbyteorder("<")).tobytes())
            docs += 1
            tokens += len(ids)
    os.replace(tmp, a.out)
    width = np.dtype(dtype).itemsize
    name = "uint16" if dtype == np.uint16 else "uint32"
    print(f"{a.out}: {docs} documents, {tokens} tokens ({names[0]} = {eos} after each), "
          f"{tokens * width} bytes as {name}; vocabulary {vocab}")
    print(f"data: {{source: tokens, path: {a.out}, token_dtype: {name}}}   # and model.args.vocab_size >= {vocab}")


if __name__ == "__main__":
    main()

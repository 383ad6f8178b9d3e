#!/usr/bin/env python3
"""Writes the small data files that configs/ train on (safetensors, inputs and targets).

    .venv/bin/python tools/reference/make_data.py

progressions.safetensors: 256 token sequences (s + k*i) mod 32 with random start s
and stride k in 1..3; targets are the inputs shifted by one. A Transformer can
learn them, so the quickstart's loss falls well below log(32).
regression.safetensors: 64 samples of 10 features and a fixed linear-plus-tanh
target, for the file-data parity experiment.
corpus.u16: a token file (data.source: tokens): the first 16384 bytes of
docs/scenarios.md as byte-level token ids (vocabulary 256), little-endian uint16.
documents.u16 and documents_b.u16 (with their indexes .docs): packed documents for data.documents
and data.sources: 600 and 300 documents of 1 to 20 tokens, each an arithmetic progression mod 62
(random start, stride 1 to 3; the second file's strides 4 to 6) followed by the end-of-document id 63,
little-endian uint16; each .docs is the documents' end offsets (uint64), as tools/prepare-data writes.
shared_params.safetensors: 4 samples for transformer_with_shared_params, each one (src, tgt) input
of the seed's forward packed as src.view(-1) ++ tgt.view(-1) (src 6 x 2, tgt 4 x 2, vocabulary 23);
sample 0 is the seed's own get_input (src arange(12), tgt arange(8)), the others random. The
targets are the tgt ids (4 x 2), as the seed's loss takes them.
"""
import array
import sys
import json
import os
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "configs", "data")
CODES = {torch.float32: "F32", torch.int64: "I64"}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_documents(path, g, docs, strides, eos=63):
    ids, ends = [], []
    for _ in range(docs):
        n = int(torch.randint(1, 21, (1,), generator=g))
        start = int(torch.randint(0, 62, (1,), generator=g))
        stride = int(torch.randint(strides[0], strides[1], (1,), generator=g))
        ids += [(start + stride * i) % 62 for i in range(n)] + [eos]
        ends.append(len(ids))
    with open(path, "wb") as f:
        f.write(struct.pack("<%dH" % len(ids), *ids))
    with open(path + ".docs", "wb") as f:
        f.write(struct.pack("<%dQ" % len(ends), *ends))


def main():
    os.makedirs(OUT, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    n, seq, vocab = 256, 32, 32
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    write_safetensors(os.path.join(OUT, "progressions.safetensors"),
                      {"inputs": tokens[:, :-1].clone(), "targets": tokens[:, 1:].clone()})
    x = torch.randn(64, 10, generator=g)
    w = torch.randn(10, 10, generator=g) / 3
    write_safetensors(os.path.join(OUT, "regression.safetensors"), {"inputs": x, "targets": torch.tanh(x @ w)})
    with open(os.path.join(HERE, "..", "..", "docs", "scenarios.md"), "rb") as f:
        ids = array.array("H", list(f.read(16384)))  # one id per byte
    if sys.byteorder != "little":
        ids.byteswap()
    with open(os.path.join(OUT, "corpus.u16"), "wb") as f:
        ids.tofile(f)
    gd = torch.Generator().manual_seed(5678)  # its own: the files above stay as they are
    for name, docs, strides in (("documents.u16", 600, (1, 4)), ("documents_b.u16", 300, (4, 7))):
        write_documents(os.path.join(OUT, name), gd, docs, strides)
    src = torch.cat([torch.arange(12).view(1, 6, 2), torch.randint(0, 23, (3, 6, 2), generator=g)])
    tgt = torch.cat([torch.arange(8).view(1, 4, 2), torch.randint(0, 23, (3, 4, 2), generator=g)])
    write_safetensors(os.path.join(OUT, "shared_params.safetensors"),
                      {"inputs": torch.cat([src.flatten(1), tgt.flatten(1)], 1), "targets": tgt})


if __name__ == "__main__":
    main()

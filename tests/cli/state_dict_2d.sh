#!/usr/bin/env bash
# 2-D state dicts (scenarios 2.B.1, 2.E) of tensor_parallel (tp 2) x fully_shard (dp 2) on
# SimpleModel and SimpleModelUneven, through checkpoints:
#  1. a run saves its sharded state (each rank's pieces of every parameter and of its Adam state)
#     at steps 4 and 5; a second run loads step 4 and trains step 5: its step-5 rank files, its
#     final.safetensors and its step-5 loss equal the first run's bit for bit, so every value,
#     Adam moment and the step count came back exactly;
#  2. the step-5 pieces assembled by the index's offsets (the full state dict) equal the run's
#     consolidated final.safetensors bit for bit;
#  3. one device resumes from the 2-D step-4 checkpoint (resharded) and ends within the config's
#     parameter tolerance of the 2-D run.
# (The consolidated full state dict against one device: golden.tp2_fsdp2_simple_model*.)
# Usage: state_dict_2d.sh COMPOSER WORK_DIR
set -u
composer=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
losses() { /usr/bin/python3 -c 'import json,sys; print(" ".join("%d:%r" % (j["step"], j["loss"]) for j in map(json.loads, open(sys.argv[1]))))' "$1"; }
for pair in "tp2_fsdp2_simple_model simple_model 1e-5" "tp2_fsdp2_simple_model_uneven simple_model_uneven 1e-10"; do
  set -- $pair
  name=$1 single=$2 tol=$3 w=$work/$1
  cfg=configs/parity/$name.yaml
  "$composer" run --config "$cfg" --out "$w/a" --set checkpoint.interval=2 --set checkpoint.resume=never \
    >"$w.a.log" 2>&1 || fail "$name: first run: $(tail -3 "$w.a.log")"
  "$composer" run --config "$cfg" --out "$w/b" --set checkpoint.resume="$w/a/checkpoints/step-000004" \
    >"$w.b.log" 2>&1 || fail "$name: resumed run: $(tail -3 "$w.b.log")"
  grep -q "resuming from $w/a/checkpoints/step-000004 (step 4 of 5)" "$w.b.log" || fail "$name: did not resume from step 4"
  n=0
  for f in "$w"/a/checkpoints/step-000005/rank-*.safetensors; do
    cmp -s "$f" "$w/b/checkpoints/step-000005/$(basename "$f")" || fail "$name: $(basename "$f") differs after the round trip"
    n=$((n + 1))
  done
  [ "$n" -eq 4 ] || fail "$name: expected 4 rank files, found $n"
  cmp -s "$w/a/final.safetensors" "$w/b/final.safetensors" || fail "$name: final.safetensors differs after the round trip"
  [ "$(losses "$w/a/metrics.jsonl" | grep -o '5:.*')" = "$(losses "$w/b/metrics.jsonl" | grep -o '5:.*')" ] ||
    fail "$name: step-5 losses differ: $(losses "$w/a/metrics.jsonl") vs $(losses "$w/b/metrics.jsonl")"
  echo "ok: $name: step-4 sharded state (params and Adam moments) loaded back; 4 step-5 rank files and final.safetensors equal bit for bit"
  /usr/bin/python3 - "$w/a/checkpoints/step-000005" "$w/a/final.safetensors" <<'PY' || fail "$name: assembled pieces differ from final.safetensors"
import json, os, struct, sys
def read(path):
    raw = open(path, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n]); data = raw[8 + n:]
    return {k: (v, data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in head.items() if k != "__metadata__"}
ck, final = sys.argv[1], read(sys.argv[2])
index = json.load(open(os.path.join(ck, "index.json")))
files = {f["name"]: read(os.path.join(ck, f["name"])) for f in index["files"]}
count = 0
for name, t in index["tensors"].items():
    if name not in final:
        continue  # optimizer state: its round trip is checked above
    head, want = final[name]
    shape = t["shape"]; got = bytearray(len(want)); covered = 0
    numel = 1
    for s in shape: numel *= s
    width = len(want) // numel  # bytes per element
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1): strides[d] = strides[d + 1] * shape[d + 1]
    for c in t["chunks"]:
        _, piece = files[c["file"]][name]
        size, off = c["size"], c["offset"]
        rows = 1
        for s in size[:-1]: rows *= s
        for r in range(rows):
            idx, rem = [], r
            for s in reversed(size[:-1]): idx.insert(0, rem % s); rem //= s
            start = sum((o + i) * st for o, i, st in zip(off[:-1], idx, strides[:-1])) + off[-1]
            n = size[-1] * width
            got[start * width:start * width + n] = piece[r * n:(r + 1) * n]
            covered += n
    assert covered == len(want), "%s: pieces cover %d of %d bytes" % (name, covered, len(want))
    assert bytes(got) == want, "%s: assembled pieces differ from final.safetensors" % name
    count += 1
assert count == len(final), "only %d of %d parameters in the checkpoint" % (count, len(final))
print("ok: %d parameters assembled from their 2-D pieces equal final.safetensors bit for bit" % count)
PY
  "$composer" run --config "configs/parity/$single.yaml" --out "$w/one" --set checkpoint.resume="$w/a/checkpoints/step-000004" \
    >"$w.one.log" 2>&1 || fail "$name: one device from the 2-D checkpoint: $(tail -3 "$w.one.log")"
  /usr/bin/python3 - "$w/a/final.safetensors" "$w/one/final.safetensors" "$tol" <<'PY' || fail "$name: one device resumed too far from the 2-D run"
import json, struct, sys
def read(p):
    raw = open(p, "rb").read(); n = struct.unpack("<Q", raw[:8])[0]; h = json.loads(raw[8:8 + n]); d = raw[8 + n:]
    fmt = {"F32": "f", "F64": "d"}
    return {k: struct.unpack("<%d%s" % ((v["data_offsets"][1] - v["data_offsets"][0]) // struct.calcsize(fmt[v["dtype"]]), fmt[v["dtype"]]),
                             d[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in h.items() if k != "__metadata__"}
a, b = read(sys.argv[1]), read(sys.argv[2])
assert a.keys() == b.keys()
diff = max(max(abs(x - y) for x, y in zip(a[k], b[k])) for k in a)
print("ok: one device resumed from the 2-D step-4 checkpoint: max parameter difference %.3g (tolerance %s)" % (diff, sys.argv[3]))
sys.exit(0 if diff <= float(sys.argv[3]) else 1)
PY
done

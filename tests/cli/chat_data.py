#!/usr/bin/env python3
"""tools/prepare-data --chat against transformers, on the chat data set of configs/data/chat/:

- it reproduces configs/data/chat.u16, .docs and .mask byte for byte from chats.jsonl and the model
  folder (so the masked fine-tuning goldens train on prepare-data's output);
- every conversation's ids are transformers' apply_chat_template(tokenize=True) ids followed by the
  end-of-text id, and its mask is transformers' own assistant mask (return_assistant_tokens_mask,
  from the template's generation markers, which prepare-data does not read);
- --loss-on last keeps only the last assistant turn, --loss-on all every token but the end-of-text
  id; --max-tokens cuts and counts; a .parquet file gives the .jsonl's bytes;
- bad input exits 2 naming the file and line: a missing role, an unknown role, an empty assistant
  turn, a conversation without an assistant turn, a template error, a folder without a template.

Usage: chat_data.py WORK_DIR
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "configs", "data")
MODEL = os.path.join(DATA, "chat", "model")
CHATS = os.path.join(DATA, "chat", "chats.jsonl")
PREPARE = os.path.join(ROOT, "tools", "prepare-data")
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAIL: ") + what)
    if not ok:
        failures.append(what)


def prepare(out, *args, model=MODEL, inputs=(CHATS,)):
    return subprocess.run([PREPARE, "--chat", model, "--out", out, *args, *inputs], capture_output=True, text=True)


def read(out):
    ids = np.fromfile(out, dtype="<u2")
    ends = np.fromfile(out + ".docs", dtype="<u8")
    mask = np.fromfile(out + ".mask", dtype=np.uint8)
    return ids, ends, mask


def split(ids, ends, mask):
    starts = [0] + ends[:-1].tolist()
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts, ends.tolist())]


def messages(obj):
    if "messages" in obj:
        return obj["messages"]
    return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]


def main():
    work = sys.argv[1]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out = os.path.join(work, "chat.u16")
    r = prepare(out)
    check(r.returncode == 0, f"prepare-data --chat exits 0 ({r.stderr.strip()[-300:]})")
    print(r.stdout.strip())
    for ext in ("", ".docs", ".mask"):
        same = open(out + ext, "rb").read() == open(os.path.join(DATA, "chat.u16" + ext), "rb").read()
        check(same, f"configs/data/chat.u16{ext} is what prepare-data writes from chats.jsonl")

    tok = AutoTokenizer.from_pretrained(MODEL)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    convs = [messages(json.loads(l)) for l in open(CHATS) if l.strip()]
    docs = split(*read(out))
    check(len(docs) == len(convs), f"one document per conversation ({len(docs)} of {len(convs)})")
    ids_equal = masks_equal = 0
    trained_text = []
    for msgs, (ids, mask) in zip(convs, docs):
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids_equal += ids == list(ref["input_ids"]) + [eos]
        masks_equal += mask == list(ref["assistant_masks"]) + [0]
        trained_text.append(tok.decode([i for i, m in zip(ids, mask) if m]))
    check(ids_equal == len(convs), f"ids are transformers' apply_chat_template ids and the end-of-text id "
                                   f"({ids_equal} of {len(convs)})")
    check(masks_equal == len(convs), f"masks are transformers' assistant masks ({masks_equal} of {len(convs)})")
    want = "".join(m["content"] + "<|im_end|>\n" for m in convs[1] if m["role"] == "assistant")
    check(trained_text[1] == want, f"conversation 2 trains its assistant turns and their ends: {trained_text[1]!r}")

    last = os.path.join(work, "last.u16")
    check(prepare(last, "--loss-on", "last").returncode == 0, "--loss-on last exits 0")
    for msgs, (ids, mask) in zip(convs[1:2], split(*read(last))[1:2]):
        text = tok.decode([i for i, m in zip(ids, mask) if m])
        check(text == msgs[-1]["content"] + "<|im_end|>\n", f"--loss-on last trains the last turn only: {text!r}")
    alltok = os.path.join(work, "all.u16")
    check(prepare(alltok, "--loss-on", "all").returncode == 0, "--loss-on all exits 0")
    ids, ends, mask = read(alltok)
    check(int(mask.sum()) == len(ids) - len(ends), "--loss-on all trains every token but the end-of-text ids")
    cut = os.path.join(work, "cut.u16")
    r = prepare(cut, "--max-tokens", "40")
    _, ends, _ = read(cut)
    lengths = np.diff(np.concatenate([[0], ends]))
    check(r.returncode == 0 and lengths.max() == 40 and "cut to --max-tokens 40:" in r.stdout,
          f"--max-tokens 40 cuts the longer conversations and counts them (longest {lengths.max()})")

    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(l) for l in open(CHATS) if l.strip()]
    pq.write_table(pa.Table.from_pylist([{"messages": messages(r)} for r in rows]), os.path.join(work, "chats.parquet"))
    pout = os.path.join(work, "parquet.u16")
    r = prepare(pout, inputs=(os.path.join(work, "chats.parquet"),))
    check(r.returncode == 0 and all(open(pout + e, "rb").read() == open(out + e, "rb").read()
                                    for e in ("", ".docs", ".mask")), "a .parquet file of the same rows gives the same bytes")

    bad = {
        "missing_role": ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}, 'message 1 has no "role"'),
        "unknown_role": ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                         'the role "robot"'),
        "empty_turn": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
                       "empty assistant turn"),
        "no_assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    }
    # The first bad file through the command (exit 2, nothing written), the others through the
    # function it runs (the same message, without a process and transformers' import each).
    sys.path.insert(0, os.path.join(ROOT, "tools", "reference"))
    import prepare_chat
    for i, (name, (obj, words)) in enumerate(bad.items()):
        path = os.path.join(work, name + ".jsonl")
        with open(path, "w") as f:
            f.write(json.dumps(rows[0]) + "\n\n" + json.dumps(obj) + "\n")
        if i == 0:
            r = prepare(os.path.join(work, name + ".u16"), inputs=(path,))
            check(r.returncode == 2 and f"{path}:3:" in r.stderr and words in r.stderr
                  and not any(n.startswith(name + ".u16") for n in os.listdir(work)),
                  f"{name}: exit 2 naming {path}:3, nothing written ({r.stderr.strip()})")
            continue
        try:
            for msgs, where in prepare_chat.conversations(path):
                prepare_chat.encode(tok, msgs, where, "assistant")
            message = ""
        except prepare_chat.ChatError as e:
            message = str(e)
        check(message.startswith(f"{path}:3:") and words in message, f"{name}: refused naming {path}:3 ({message})")
    broken = os.path.join(work, "broken_model")
    shutil.copytree(MODEL, broken)
    cfg = json.load(open(os.path.join(broken, "tokenizer_config.json")))
    cfg["chat_template"] = "{{ raise_exception('this template refuses every conversation') }}"
    json.dump(cfg, open(os.path.join(broken, "tokenizer_config.json"), "w"))
    r = prepare(os.path.join(work, "broken.u16"), model=broken)
    check(r.returncode == 2 and f"{CHATS}:1:" in r.stderr and "chat template fails" in r.stderr,
          f"a template error: exit 2 naming {CHATS}:1 ({r.stderr.strip()})")
    del cfg["chat_template"]
    json.dump(cfg, open(os.path.join(broken, "tokenizer_config.json"), "w"))
    r = prepare(os.path.join(work, "none.u16"), model=broken)
    check(r.returncode == 2 and "no chat template" in r.stderr, f"no template: exit 2 ({r.stderr.strip()})")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")
    print("chat data: all checks passed")


if __name__ == "__main__":
    main()

"""tools/prepare-data --chat MODEL_DIR: conversations to composer's token file, document index and loss mask.

Each conversation is rendered with the model folder's own chat template (transformers' tokenizer:
tokenizer_config.json's chat_template, or chat_template.jinja, as Hugging Face ships them),
tokenised, and written as one document. Beside OUT and OUT.docs (as for text, prepare_data.py) it
writes OUT.mask: one byte per token, 1 where the token is trained as a target (the loss of
predicting it from the tokens before it), 0 elsewhere; composer reads it with data.loss_mask: true.

Which tokens are trained (--loss-on):
  assistant  (default) every assistant turn: its content and what the template closes it with
             (e.g. ChatML's <|im_end|>), not the header that opens it (the generation prompt);
  last       the last assistant turn only;
  all        every token.
An assistant turn's tokens are found by rendering the conversation up to the turn with the
generation prompt and up to its end: the characters between the two are the turn's, and a token
is trained when its first character is one of them. A template whose rendering of a conversation's
beginning is not the beginning of the whole (one that rewrites earlier turns) is refused.

Inputs: .jsonl lines (blank lines skipped) and .parquet rows, each a conversation:
  {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}, or
  {"prompt": "...", "completion": "..."} (a user turn and an assistant turn; either may also be a
  list of messages, as TRL's conversational prompt-completion data sets hold them).
A missing or unknown role, content that is not a string, an empty assistant turn, a conversation
without an assistant turn (unless --loss-on all) and a template error stop the run with exit code
2, naming the file and line (or row).

Truncation: a conversation is one document, packed with the others; composer's windows
(data.seq_len + 1 tokens) may start or end inside it, and data.documents: {mask: true} keeps
attention within it. With --max-tokens N, a conversation longer than N tokens keeps its first N
(counted in the report); by default none is cut.
"""
import json
import os
import sys
import time

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("assistant", "last", "all")


class ChatError(Exception):
    """Bad input: prepare_data reports it with exit code 2."""


def load_chat_tokenizer(folder):
    if not os.path.isdir(folder):
        raise ChatError(f"--chat {folder}: not a folder (give a Hugging Face model folder with its tokenizer "
                        "and chat template)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # transformers raises many kinds for an unreadable folder
        raise ChatError(f"--chat {folder}: no tokenizer transformers can load ({type(e).__name__}: {e})") from None
    if not getattr(tok, "is_fast", False):
        raise ChatError(f"--chat {folder}: its tokenizer is not a fast (tokenizer.json) one; the token offsets "
                        "that place the loss mask need one")
    if not tok.chat_template:
        raise ChatError(f"--chat {folder}: no chat template (tokenizer_config.json's chat_template or "
                        "chat_template.jinja); use a chat model's folder, or prepare plain text without --chat")
    return tok


def json_lines(path, error):
    """(line number, object, bytes) for every non-blank line of a .jsonl file (also prepare_data's);
    `error`, an exception class, for an unreadable file or a line that is not JSON."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise error(f"{path}: {e.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not JSON (column {e.colno}: {e.msg})") from None
            except UnicodeDecodeError as e:
                raise error(f"{path}:{n}: not UTF-8 (byte {e.start} of the line)") from None
            yield n, obj, len(line)


def conversations(path):
    """(messages, where) for every conversation of a .jsonl or .parquet file, where = 'path:line' or 'path: row n'."""
    if path.endswith(".jsonl"):
        for n, obj, _ in json_lines(path, ChatError):
            yield messages_of(obj, f"{path}:{n}"), f"{path}:{n}"
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise ChatError(f"{path}: not a Parquet file ({e})") from None
        for n, row in enumerate(table.to_pylist(), 1):
            yield messages_of(row, f"{path}: row {n}"), f"{path}: row {n}"
    else:
        raise ChatError(f"{path}: --chat reads .jsonl and .parquet files")


def messages_of(obj, where):
    if not isinstance(obj, dict):
        raise ChatError(f'{where}: not an object with "messages" or "prompt" and "completion"')
    if "messages" in obj:
        msgs = obj["messages"]
    elif "prompt" in obj and "completion" in obj:
        def turns(x, role):
            return x if isinstance(x, list) else [{"role": role, "content": x}]
        msgs = turns(obj["prompt"], "user") + turns(obj["completion"], "assistant")
    else:
        raise ChatError(f'{where}: no "messages", nor "prompt" and "completion" (its keys: {", ".join(obj) or "none"})')
    if not isinstance(msgs, list) or not msgs:
        raise ChatError(f"{where}: the messages are not a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatError(f'{where}: message {i + 1} has no "role"')
        if m["role"] not in ROLES:
            raise ChatError(f'{where}: message {i + 1} has the role "{m["role"]}", not one of {", ".join(ROLES)}')
        if not isinstance(m.get("content"), str):
            raise ChatError(f'{where}: message {i + 1} ({m["role"]}) has no string "content"')
        if m["role"] == "assistant" and not m["content"].strip():
            raise ChatError(f"{where}: message {i + 1} is an empty assistant turn (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def render(tok, msgs, where, generation_prompt=False):
    try:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2's TemplateError, or a template's own raise_exception
        raise ChatError(f"{where}: the chat template fails on this conversation ({type(e).__name__}: {e})") from None


def encode(tok, msgs, where, loss_on):
    """The conversation's ids and their mask (1: trained as a target)."""
    text = render(tok, msgs, where)
    spans = []
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if loss_on != "all" and not turns:
        raise ChatError(f"{where}: no assistant turn (nothing to train on); drop it, or train on every token "
                        "with --loss-on all")
    if loss_on == "last":
        turns = turns[-1:]
    if loss_on != "all":
        for i in turns:
            before = render(tok, msgs[:i], where, generation_prompt=True) if i else ""
            through = render(tok, msgs[:i + 1], where)
            if not (text.startswith(before) and text.startswith(through) and len(before) < len(through)):
                raise ChatError(f"{where}: the chat template renders the conversation's first {i + 1} messages as "
                                "other than the beginning of the whole (it rewrites earlier turns), so the "
                                "assistant turns cannot be placed; use --loss-on all, or a template that does not")
            spans.append((len(before), len(through)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if loss_on == "all":
        mask = [1] * len(ids)
    else:
        mask = [1 if any(a <= s < b for a, b in spans) else 0 for s, _ in enc["offset_mapping"]]
    return ids, mask


def prepare_chat(a, out_dtype_for, report):
    """Writes OUT, OUT.docs and OUT.mask from a.files' conversations; returns the counts for the report."""
    tok = load_chat_tokenizer(a.chat)
    eos_name = a.eos or tok.eos_token
    eos = tok.convert_tokens_to_ids(eos_name) if eos_name else None
    if eos is None or eos == tok.unk_token_id:
        raise ChatError(f"--chat {a.chat}: no end-of-text token{' named ' + a.eos if a.eos else ''}; name one with --eos")
    vocab = len(tok)
    dtype = out_dtype_for(vocab)
    out, index, maskf = a.out, a.out + ".docs", a.out + ".mask"
    tmps = [p + ".tmp" for p in (out, index, maskf)]
    start = time.monotonic()
    docs = tokens = trained = cut = 0
    try:
        with open(tmps[0], "wb") as f, open(tmps[1], "wb") as g, open(tmps[2], "wb") as h:
            for path in a.files:
                for msgs, where in conversations(path):
                    ids, mask = encode(tok, msgs, where, a.loss_on)
                    ids, mask = ids + [eos], mask + [0]  # the end-of-text id ends the document, never trained
                    if a.max_tokens and len(ids) > a.max_tokens:
                        ids, mask, cut = ids[:a.max_tokens], mask[:a.max_tokens], cut + 1
                    if max(ids) >= 1 << (8 * dtype.itemsize):
                        raise ChatError(f"{where}: token id {max(ids)} does not fit {dtype.name}")
                    f.write(np.asarray(ids, dtype=dtype).tobytes())
                    h.write(np.asarray(mask, dtype=np.uint8).tobytes())
                    docs += 1
                    tokens += len(ids)
                    trained += sum(mask)
                    g.write(np.asarray([tokens], dtype="<u8").tobytes())
        if not docs:
            raise ChatError("the inputs hold no conversations")
        for tmp, final in zip(tmps, (out, index, maskf)):
            os.replace(tmp, final)
    except BaseException:
        for p in tmps:
            if os.path.exists(p):
                os.remove(p)
        raise
    seconds = time.monotonic() - start
    print(f"{out}: {docs} conversations, {tokens} tokens ({eos_name} = {eos} after each), "
          f"{tokens * dtype.itemsize} bytes as {dtype.name}; vocabulary {vocab}")
    print(f"{index}: {docs} document ends; {maskf}: {tokens} bytes, {trained} tokens trained "
          f"({100.0 * trained / tokens:.1f}%), {tokens - trained} masked ({100.0 * (tokens - trained) / tokens:.1f}%), "
          f"loss on {a.loss_on} tokens")
    if a.max_tokens:
        print(f"conversations cut to --max-tokens {a.max_tokens}: {cut}")
    print(f"{len(a.files)} files in {seconds:.2f} s with the chat template of {a.chat}")
    report(f"data: {{source: tokens, path: {out}, token_dtype: {dtype.name}, documents: {{mask: true}}, "
           f"loss_mask: true}}   # and model.args.vocab_size >= {vocab}")

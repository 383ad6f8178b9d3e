#!/usr/bin/env python3
"""Text to composer's token file and document index, with a Hugging Face tokenizer.json.

    tools/prepare-data --tokenizer tokenizer.json --out corpus.bin FILE_OR_FOLDER [...]
    tools/prepare-data --tokenizer tokenizer.json --out corpus.bin --workers 8 shards/ notes/*.md

Inputs: a .txt or .md file is one document; each line of a .jsonl file is one document, the string
in its "text" field (blank lines are skipped); each row of a .parquet file is one document, its
"text" column. --text-field NAME reads another field or column. A folder is read recursively, its
files in the sorted order of their paths; files with other extensions there are skipped and
counted, while such a file named on the command line is an error. Bad input (a missing file, a
line that is not a JSON object with a string field, a missing column, text that is not UTF-8)
stops the run with exit code 2 and the file and line (or row, from 1) in the message; nothing is
left at OUT then.

Outputs, each written to a .tmp file and renamed into place at the end:
  OUT       every document's ids followed by the end-of-text id, one document after another, as
            little-endian uint16 when the vocabulary has at most 65536 entries, else uint32:
            composer's data: {source: tokens, path: OUT, token_dtype: ...}.
  OUT.docs  little-endian uint64, one entry per document: the end (exclusive, in tokens) of that
            document in OUT. Document d spans [end[d-1], end[d]) with end[-1] = 0, its end-of-text
            id as its last token; the last entry is OUT's token count. composer reads it for
            data.documents: {mask: true}.

--eos TOKEN names the end-of-text token (by default the tokenizer's first special token among
<|endoftext|>, <|end_of_text|>, </s>, <eos>, [SEP]). A document whose text contains that token's
string gets its id there too (the tokenizer matches special tokens in text); OUT.docs still
marks the true ends, and the run counts such documents.

Documents are tokenised in chunks (--chunk-docs documents, at most 4 MiB of input) by --workers
processes, each loading the tokenizer once and tokenising on one thread; a few chunks per worker
are in flight at a time, so memory stays bounded whatever the corpus size, and results are
written in input order: the outputs are the same bytes for any --workers. The tokenizers library
needs about 150 bytes of memory per byte of text it encodes at once: for byte-level BPE
tokenizers with GPT-2's or Llama 3's pattern, a document over 2 * ENCODE_CHARS characters is
encoded in pieces cut where its ids stay the same (CUT); with other tokenizers it is encoded
whole, so memory also grows with the longest document. A progress line goes
to stderr; at the end the counts, the time, tokens per second, the peak resident memory and the
data section to use are printed. Any tokenizer.json works, for example a Hugging Face model
folder's (Llama 3's has 128256 entries, so uint32); a model's vocab_size must exceed every id.

--chat MODEL_DIR reads conversations (.jsonl and .parquet: "messages", or "prompt" and
"completion") instead, renders them with the folder's chat template and writes OUT.mask too: one
byte per token, 1 where it is trained (data.loss_mask: true); see prepare_chat.py.
"""
import argparse
import collections
import json
import multiprocessing
import os
import re
import resource
import signal
import sys
import time

# One thread per worker process: --workers is the number of cores tokenising. Set before the
# tokenizers library is loaded.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import prepare_chat  # noqa: E402
from prepare_chat import json_lines  # noqa: E402

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
KINDS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".parquet": "parquet"}
CLEAR = "\r\x1b[K"  # erases the progress line on a terminal
CHUNK_BYTES = 4 << 20  # input bytes per chunk at most (a larger document is a chunk of its own)
# The tokenizers library needs about 150 bytes of memory per byte of text it encodes at once, so a
# worker encodes about this many characters at a time, cutting longer documents where that keeps
# their ids unchanged (cuttable, CUT).
ENCODE_CHARS = 1 << 18
# Where a long document is cut: between an ASCII letter or digit and an ASCII space, tab, CR or LF.
# For the pre-tokenizers cuttable accepts, no pre-token holds both characters, a pre-token's match
# depends only on the text from its start on (no look-behind), and the pre-token ending with the
# letter or digit ends there whether the text goes on or not; the model encodes each pre-token on
# its own, so the pieces' ids, joined, are the whole document's.
CUT = re.compile(r"(?<=[A-Za-z0-9])(?=[ \t\r\n])")
# The split pattern of Llama 3's tokenizer.json (and of cl100k), before ByteLevel(use_regex=false).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class InputError(Exception):
    """Bad input: reported as 'prepare-data: MESSAGE' with exit code 2."""


def kind(path):
    return KINDS.get(os.path.splitext(path)[1].lower())


def input_files(paths):
    """The files to read, in order: each argument in turn, a folder's files sorted by path."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            found, skipped = [], 0
            for root, dirs, names in os.walk(p):
                for name in names:
                    f = os.path.join(root, name)
                    if kind(f):
                        found.append(f)
                    else:
                        skipped += 1
            found.sort(key=lambda f: os.path.relpath(f, p).split(os.sep))
            files += found
            print(f"prepare-data: {p}: {len(found)} files to read"
                  + (f", {skipped} skipped (not .txt, .md, .jsonl or .parquet)" if skipped else ""),
                  file=sys.stderr)
        elif os.path.isfile(p):
            if not kind(p):
                raise InputError(f"{p}: not a .txt, .md, .jsonl or .parquet file")
            files.append(p)
        else:
            raise InputError(f"{p}: no such file or folder")
    if not files:
        raise InputError("no .txt, .md, .jsonl or .parquet files among the inputs")
    return files


def text_document(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    try:
        yield data.decode("utf-8"), len(data)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None


def jsonl_documents(path, field):
    for n, obj, size in json_lines(path, InputError):
        if not isinstance(obj, dict) or field not in obj:
            raise InputError(f'{path}:{n}: not a JSON object with a "{field}" field'
                             + ("" if field != "text" else "; name another with --text-field"))
        text = obj[field]
        if not isinstance(text, str):
            raise InputError(f'{path}:{n}: the "{field}" field is a {type(text).__name__}, not a string')
        yield text, size


def parquet_documents(path, field, batch):
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading .parquet files needs pyarrow (tools/setup installs it)") from None
    try:
        pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)  # read as decoded, not row groups whole
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}" if e.strerror else f"{path}: not a Parquet file ({e})") from None
    except pa.ArrowException as e:
        raise InputError(f"{path}: not a Parquet file ({e})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise InputError(f'{path}: no column "{field}" (its columns: {", ".join(schema.names) or "none"}); '
                         "name one with --text-field")
    t = schema.field(field).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        raise InputError(f'{path}: column "{field}" holds {t}, not strings')
    # Rows per batch: at most batch, and about CHUNK_BYTES by the file's mean row size.
    md = pf.metadata
    row_bytes = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups)) / max(md.num_rows, 1)
    batch = max(1, min(batch, int(CHUNK_BYTES / max(row_bytes, 1))))
    row = 0
    try:
        for b in pf.iter_batches(batch_size=batch, columns=[field], use_threads=False):
            col = b.column(0)
            if col.null_count:
                first = pc.index(pc.is_null(col), True).as_py()
                raise InputError(f'{path}: row {row + first + 1}: "{field}" is null')
            sizes = pc.binary_length(col).to_numpy(zero_copy_only=False)
            for text, size in zip(col.to_pylist(), sizes.tolist()):
                yield text, size
            row += len(col)
    except pa.ArrowException as e:
        raise InputError(f"{path}: after row {row}: unreadable ({e})") from None


def documents(files, field, batch):
    """(text, input bytes) for every document, in input order."""
    for path in files:
        k = kind(path)
        if k == "text":
            yield from text_document(path)
        elif k == "jsonl":
            yield from jsonl_documents(path, field)
        else:
            yield from parquet_documents(path, field, batch)


def chunks(docs, max_docs):
    """Lists of at most max_docs texts and about CHUNK_BYTES of input, with their input bytes."""
    texts, size = [], 0
    for text, nbytes in docs:
        texts.append(text)
        size += nbytes
        if len(texts) >= max_docs or size >= CHUNK_BYTES:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


def cuttable(config):
    """Whether long documents may be cut at CUT for the tokenizer.json whose JSON is config: no
    normalizer, added tokens without white space that match their text only, and a byte-level
    pre-tokenizer with GPT-2's pattern (use_regex) or Llama 3's split pattern, no prefix space."""
    def byte_level(p, regex):
        return (p.get("type") == "ByteLevel" and p.get("add_prefix_space") is False
                and p.get("use_regex", True) is regex)
    if config.get("normalizer") is not None or (config.get("model") or {}).get("dropout"):
        return False
    for t in config.get("added_tokens") or []:
        content = t.get("content", " ")
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word") or any(c.isspace() for c in content):
            return False
    pre = config.get("pre_tokenizer") or {}
    if byte_level(pre, True):
        return True
    seq = pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else []
    return (len(seq) == 2 and seq[0].get("type") == "Split" and seq[0].get("pattern") == {"Regex": LLAMA3_PATTERN}
            and seq[0].get("behavior") == "Isolated" and seq[0].get("invert") is False and byte_level(seq[1], False))


def pieces(text):
    """text cut at CUT into pieces of about ENCODE_CHARS characters or more (itself if short)."""
    out, start = [], 0
    while len(text) - start > 2 * ENCODE_CHARS:
        m = CUT.search(text, start + ENCODE_CHARS)
        if m is None:
            break
        out.append(text[start:m.start()])
        start = m.start()
    out.append(text[start:] if start else text)
    return out


_worker = None  # (tokenizer, eos id, numpy dtype, cut long documents), set once per process by init_worker


def init_worker(tokenizer, eos, dtype, cut):
    global _worker
    _worker = (Tokenizer.from_file(tokenizer), eos, np.dtype(dtype), cut)



def encode_pieces(batch, lengths, held):
    """The ids of batch, a list of (text, document, last piece of it), with the end-of-text id
    after each document's last piece, as bytes; adds to lengths and marks held (see encode_chunk)."""
    tok, eos, dtype, _ = _worker
    ids = []
    for enc, (_, d, last) in zip(tok.encode_batch_fast([b[0] for b in batch], add_special_tokens=False), batch):
        piece = enc.ids
        if eos in piece:
            held[d] = True
        ids += piece
        if last:
            ids.append(eos)
        lengths[d] += len(piece) + last
    return np.array(ids, dtype=dtype).tobytes()


def encode_chunk(texts):
    """One chunk's tokens (bytes in the output's dtype), its documents' lengths with their
    end-of-text ids, and how many of its documents hold the end-of-text id in their text."""
    cut = _worker[3]
    lengths, held = np.zeros(len(texts), np.int64), np.zeros(len(texts), bool)
    out, batch, size = [], [], 0
    for d, text in enumerate(texts):
        parts = pieces(text) if cut else [text]
        for k, part in enumerate(parts):
            batch.append((part, d, k == len(parts) - 1))
            size += len(part)
            if size >= ENCODE_CHARS:
                out.append(encode_pieces(batch, lengths, held))
                batch, size = [], 0
    if batch:
        out.append(encode_pieces(batch, lengths, held))
    return b"".join(out), lengths, int(held.sum())


class Progress:
    """A line on stderr, rewritten at most four times a second on a terminal, else one every 10 s."""

    def __init__(self, start):
        self.start, self.tty = start, sys.stderr.isatty()
        self.interval, self.last, self.shown = (0.25 if self.tty else 10.0), start, False

    def update(self, docs, tokens, nbytes, force=False):
        now = time.monotonic()
        if not force and now - self.last < self.interval:
            return
        self.last, self.shown = now, True
        rate = tokens / max(now - self.start, 1e-9)
        line = (f"prepare-data: {docs} documents, {tokens} tokens, {nbytes / 1e6:.1f} MB read, "
                f"{rate:,.0f} tokens/s")
        sys.stderr.write(CLEAR + line if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self, docs, tokens, nbytes):
        if self.tty and self.shown:
            self.update(docs, tokens, nbytes, force=True)
            sys.stderr.write("\n")


def encoded(chunk_iter, pool, depth):
    """((tokens, lengths, inner), input bytes) per chunk, in input order, with at most depth
    chunks handed to the pool and not yet written."""
    if pool is None:
        for texts, size in chunk_iter:
            yield encode_chunk(texts), size
        return
    pending = collections.deque()
    for texts, size in chunk_iter:
        pending.append((pool.apply_async(encode_chunk, (texts,)), size))
        if len(pending) >= depth:
            r, s = pending.popleft()
            yield r.get(), s
    while pending:
        r, s = pending.popleft()
        yield r.get(), s


def load_tokenizer(path, eos_name):
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library raises plain Exceptions for unreadable files
        raise InputError(f"{path}: not a tokenizer.json ({e})") from None
    names = [eos_name] if eos_name else [n for n in EOS_NAMES if tok.token_to_id(n) is not None][:1]
    if not names or tok.token_to_id(names[0]) is None:
        raise InputError(f"{path} has no end-of-text token "
                         f"{'named ' + eos_name if eos_name else 'among ' + ', '.join(EOS_NAMES)}; name one with --eos")
    with open(path, encoding="utf-8") as f:
        cut = cuttable(json.load(f))
    return tok.get_vocab_size(with_added_tokens=True), names[0], tok.token_to_id(names[0]), cut


def prepare(a):
    vocab, eos_name, eos, cut = load_tokenizer(a.tokenizer, a.eos)
    files = input_files(a.files)
    out, index = a.out, a.out + ".docs"
    if os.path.isdir(out):
        raise InputError(f"--out {out}: a folder")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    dtype = np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")
    start = time.monotonic()
    pool = None
    if a.workers > 1:  # started before any input is opened, so the workers fork from a plain process
        # The workers start with Ctrl-C ignored and SIGTERM fatal, as the kernel handles them: a
        # Python handler could miss a SIGTERM that comes before the new process has set up (Python
        # drops signals pending at a fork), and Pool.terminate would then wait for it forever.
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        sigterm = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            pool = multiprocessing.Pool(a.workers, init_worker, (a.tokenizer, eos, dtype.str, cut))
        finally:
            signal.signal(signal.SIGINT, sigint)
            signal.signal(signal.SIGTERM, sigterm)
    else:
        init_worker(a.tokenizer, eos, dtype.str, cut)
    tmp, index_tmp = out + ".tmp", index + ".tmp"
    docs = tokens = nbytes = inner = 0
    progress = Progress(start)
    try:
        with open(tmp, "wb") as f, open(index_tmp, "wb") as g:
            stream = chunks(documents(files, a.text_field, a.chunk_docs), a.chunk_docs)
            for (data, lengths, n_inner), size in encoded(stream, pool, 2 * a.workers + 2):
                ends = tokens + np.cumsum(lengths, dtype=np.int64)
                f.write(data)
                g.write(ends.astype("<u8").tobytes())
                docs += len(lengths)
                tokens = int(ends[-1])
                nbytes += size
                inner += n_inner
                progress.update(docs, tokens, nbytes)
        if not docs:
            raise InputError("the inputs hold no documents (only blank .jsonl lines or empty .parquet files)")
        if pool is not None:
            pool.close()
            pool.join()
        os.replace(index_tmp, index)
        os.replace(tmp, out)
    except BaseException:
        if pool is not None:
            pool.terminate()
        for p in (tmp, index_tmp):
            if os.path.exists(p):
                os.remove(p)
        raise
    seconds = time.monotonic() - start
    progress.close(docs, tokens, nbytes)
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    rss_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    name = dtype.name
    print(f"{out}: {docs} documents, {tokens} tokens ({eos_name} = {eos} after each), "
          f"{tokens * dtype.itemsize} bytes as {name}; vocabulary {vocab}")
    print(f"{index}: {docs} document ends, {8 * docs} bytes as uint64")
    print(f"{len(files)} files, {nbytes / 1e6:.1f} MB read in {seconds:.2f} s with {a.workers} "
          f"worker{'s' * (a.workers != 1)}: {tokens / max(seconds, 1e-9):,.0f} tokens/s; peak RSS "
          f"{rss_self + rss_child:.0f} MiB (main process {rss_self:.0f} MiB"
          + (f", largest worker {rss_child:.0f} MiB)" if pool is not None else ")"))
    if inner:
        print(f"documents holding {eos_name} in their text: {inner} ({index} keeps each whole; "
              "the end-of-text id alone would split them)")
    print(f"data: {{source: tokens, path: {out}, token_dtype: {name}, documents: {{mask: true}}}}"
          f"   # and model.args.vocab_size >= {vocab}; composer reads the document ends from {index}")
    print(f"# or, ending documents at the end-of-text id instead of {index}: documents: {{mask: true, eos_id: {eos}}}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a tokenizer.json (text documents)")
    ap.add_argument("--chat", metavar="MODEL_DIR",
                    help="conversations instead of text: render them with this Hugging Face model folder's chat "
                         "template and tokenizer and write OUT.mask beside OUT and OUT.docs (prepare_chat.py)")
    ap.add_argument("--loss-on", choices=["assistant", "last", "all"], default="assistant",
                    help="with --chat: the tokens OUT.mask trains: every assistant turn (default), the last one, "
                         "or all")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="with --chat: keep a longer conversation's first N tokens (default: cut none)")
    ap.add_argument("--out", required=True, help="the token file to write (and OUT.docs, its document index)")
    ap.add_argument("--eos", help="the end-of-text token appended after every document")
    ap.add_argument("--text-field", default="text",
                    help='the .jsonl field and .parquet column to read (default "text")')
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    ap.add_argument("--workers", type=int, default=cpus,
                    help=f"tokenising processes (default: the CPUs this process may use, here {cpus})")
    ap.add_argument("--chunk-docs", type=int, default=1000, help="documents per chunk at most (default 1000)")
    ap.add_argument("files", nargs="+", help=".txt/.md/.jsonl/.parquet files, or folders of them")
    a = ap.parse_args()
    if a.workers < 1 or a.chunk_docs < 1:
        ap.error("--workers and --chunk-docs must be at least 1")
    if bool(a.tokenizer) == bool(a.chat):
        ap.error("give --tokenizer (text) or --chat MODEL_DIR (conversations), one of them")
    if not a.chat and (a.loss_on != "assistant" or a.max_tokens):
        ap.error("--loss-on and --max-tokens belong to --chat")
    if a.max_tokens < 0:
        ap.error("--max-tokens must be positive")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # exits through the clean-up: no .tmp files left
    try:
        if a.chat:
            try:
                a.files = input_files(a.files)
                prepare_chat.prepare_chat(a, lambda vocab: np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4"),
                                          print)
            except prepare_chat.ChatError as e:
                raise InputError(str(e)) from None
        else:
            prepare(a)
    except InputError as e:
        print(f"{CLEAR if sys.stderr.isatty() else ''}prepare-data: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{CLEAR if sys.stderr.isatty() else ''}prepare-data: interrupted; nothing written", file=sys.stderr)
        sys.exit(130)
    except OSError as e:  # writing the outputs (a full disk, a folder without write permission)
        print(f"{CLEAR if sys.stderr.isatty() else ''}prepare-data: {e.filename or a.out}: {e.strerror or e}; "
              "nothing written", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

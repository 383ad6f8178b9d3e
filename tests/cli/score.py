#!/usr/bin/env python3
"""composer score against transformers' log-probabilities.

A random LlamaForCausalLM (grouped-query attention, norms drawn away from one) is saved with
save_pretrained and read with from_hf. A token file of 11 documents (1 to 33 tokens; seq_len 32, so
the longest fills a row) with a random loss mask is scored by `composer score --per-token` on one
device and under tp 2 (sequence and loss parallel) x fully_shard dp 2, context parallel 2 and a 1f1b
pipeline of 2 stages, 4 sequences a batch (so the last batch has empty rows). Each run must give, for
every sequence, every target's log-probability as transformers computes it (log_softmax of the
logits, float32) and the sum over the targets the mask counts, with their count. A sequence longer
than data.seq_len + 1 is refused (exit 2). With --weights, the final weights of 2 SGD steps, scored under
tp x fully_shard, give transformers' log-probabilities of their Hugging Face export; a file that holds no
weights is refused (exit 2).

Usage: score.py COMPOSER WORK_DIR
"""
import json
import os
import subprocess
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

COMPOSER, WORK = sys.argv[1], sys.argv[2]
VOCAB, SEQ = 96, 32
TOKEN_ATOL = 3e-5  # one log-probability (magnitude ~5), float32 on both sides, other summation orders
SUM_RTOL = 1e-5    # a sequence's sum of up to 32 of them
LENGTHS = [5, 33, 1, 17, 2, 9, 30, 12, 24, 3, 20]
PLANS = {
    "one": "",
    "tp_fsdp": """mesh: {shape: [2, 2], names: [dp, tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp, sequence_parallel: true, loss_parallel: true}
  - fully_shard: {mesh_dim: dp}""",
    "cp": """mesh: {shape: [2], names: [cp]}
parallelize:
  - context_parallel: {mesh_dim: cp}""",
    "pp": """mesh: {shape: [2], names: [pp]}
parallelize:
  - pipeline: {mesh_dim: pp, schedule: 1f1b, layers_per_stage: 1}""",
}


def fail(message):
    sys.exit(f"score: {message}")


def composer(*args, expect=0):
    r = subprocess.run([COMPOSER, *args], capture_output=True, text=True)
    if r.returncode != expect:
        fail(f"composer {' '.join(args)} exited {r.returncode}, expected {expect}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


def base_model(folder):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.25)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model.eval()


def token_file(path):
    """The documents, their ends (path.docs) and a random loss mask (path.mask)."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, VOCAB, size=n) for n in LENGTHS]
    np.concatenate(docs).astype("<u2").tofile(path)
    np.cumsum(LENGTHS).astype("<u8").tofile(path + ".docs")
    mask = rng.integers(0, 2, size=sum(LENGTHS)).astype(np.uint8)
    mask.tofile(path + ".mask")
    return docs, mask


def config(name, hf_dir, data, plan):
    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        f.write(f"""name: score_{name}
seed: 0
model: {{name: llama, from_hf: {hf_dir}}}
{plan}
train:
  global_batch: 4
  microbatches: 2
  optimizer: {{name: sgd, lr: 0.1}}
  loss: {{name: cross_entropy}}
data: {{source: tokens, path: {data}, token_dtype: uint16, seq_len: {SEQ}}}
""")
    return path


def check_trained_weights(hf_dir, data, docs, untrained):
    """--weights: a run's final weights scored under tp x fully_shard equal transformers' log-probabilities of
    the same weights (exported to a Hugging Face folder and loaded by from_pretrained)."""
    cfg = config("trained", hf_dir, data, "")
    run_dir = os.path.join(WORK, "trained")
    composer("run", "--config", cfg, "--out", run_dir, "--set", "train.steps=2")
    final = os.path.join(run_dir, "final.safetensors")
    exported = os.path.join(WORK, "trained_hf")
    composer("export", "--config", cfg, "--weights", final, "--format", "hf", "--out", exported)
    model = LlamaForCausalLM.from_pretrained(exported).float()
    out = os.path.join(WORK, "trained.jsonl")
    composer("score", "--config", config("trained_tp_fsdp", hf_dir, data, PLANS["tp_fsdp"]), "--data", data,
             "--weights", final, "--out", out, "--per-token")
    worst = moved = 0.0
    with torch.no_grad():
        for line, d, before in zip((json.loads(l) for l in open(out)), docs, untrained):
            ids = torch.tensor(d, dtype=torch.long)[None]
            lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
            if lp.numel():
                got = torch.tensor(line["token_logprobs"], dtype=torch.double)
                worst = max(worst, (got - lp.double()).abs().max().item())
                moved = max(moved, (got - before).abs().max().item())
    print(f"--weights (2 SGD steps' final weights) under tp x fully_shard vs transformers on their export: max abs "
          f"log-probability difference {worst:.3g} (training moved them by up to {moved:.3g})")
    if worst > TOKEN_ATOL or moved < 100 * TOKEN_ATOL:
        fail(f"scores with --weights differ from transformers' on the same weights by {worst:.3g}, or from the "
             f"untrained model's by only {moved:.3g}")
    out = composer("score", "--config", cfg, "--data", data, "--weights", os.path.join(WORK, "docs.u16"),
                   "--out", os.path.join(WORK, "refused.jsonl"), expect=2)
    print("--weights of a file that is no weights file:", out.strip().splitlines()[-1])


def main():
    os.makedirs(WORK, exist_ok=True)
    hf_dir = os.path.join(WORK, "hf")
    model = base_model(hf_dir)
    data = os.path.join(WORK, "docs.u16")
    docs, mask = token_file(data)
    want = []  # each document's target log-probabilities, by transformers
    with torch.no_grad():
        for d in docs:
            ids = torch.tensor(d, dtype=torch.long)[None]
            lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0, :-1]
            want.append(lp.gather(1, ids[0, 1:, None])[:, 0].double())
    begin = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]])
    counted = [mask[b + 1:b + n].astype(bool) for b, n in zip(begin, LENGTHS)]
    for name, plan in PLANS.items():
        cfg = config(name, hf_dir, data, plan)
        out = os.path.join(WORK, name + ".jsonl")
        print(composer("score", "--config", cfg, "--data", data, "--out", out, "--per-token").strip().splitlines()[-1])
        lines = [json.loads(line) for line in open(out)]
        if [l["index"] for l in lines] != list(range(len(docs))):
            fail(f"{name}: {len(lines)} lines, not one per sequence in order")
        worst_token = worst_sum = 0.0
        for q, line in enumerate(lines):
            got = torch.tensor(line["token_logprobs"], dtype=torch.double)
            c = torch.tensor(counted[q], dtype=torch.bool)
            if line["tokens"] != LENGTHS[q] or got.numel() != LENGTHS[q] - 1 or line["targets"] != int(c.sum()):
                fail(f"{name}: sequence {q}: tokens {line['tokens']}, {got.numel()} log-probabilities and "
                     f"{line['targets']} counted targets; want {LENGTHS[q]}, {LENGTHS[q] - 1} and {int(c.sum())}")
            if line["counted"] != c.int().tolist():
                fail(f"{name}: sequence {q}: counted {line['counted']}, the mask gives {c.int().tolist()}")
            if got.numel():
                worst_token = max(worst_token, (got - want[q]).abs().max().item())
            total = want[q][c].sum().item()
            worst_sum = max(worst_sum, abs(line["logprob"] - total) / max(abs(total), 1.0))
        print(f"{name}: {len(lines)} sequences vs transformers: max abs log-probability difference "
              f"{worst_token:.3g}, sums within {worst_sum:.3g} (relative)")
        if worst_token > TOKEN_ATOL or worst_sum > SUM_RTOL:
            fail(f"{name}: the scores differ from transformers' (token {worst_token:.3g}, sum {worst_sum:.3g})")
    check_trained_weights(hf_dir, data, docs, want)
    out = composer("score", "--config", config("one", hf_dir, data, ""), "--data", data, "--set", "data.seq_len=16",
                   "--out", os.path.join(WORK, "refused.jsonl"), expect=2)
    if "data.seq_len" not in out or "sequence 1 holds 33 tokens" not in out:
        fail(f"a sequence longer than data.seq_len + 1: {out}")
    print("score: all checks passed")


if __name__ == "__main__":
    main()

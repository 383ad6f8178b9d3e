#!/usr/bin/env python3
"""Hugging Face Mixtral in and out, proven with transformers itself.

Random MixtralForCausalLM models (4 experts, 2 per token, grouped-query
attention; weights drawn wide, so that a wrong name, expert order, w1/w3 swap,
routing rule or rotary order moves the loss by far more than the tolerance, and
so that every token's top-2 experts win by a clear margin) are saved with
save_pretrained, offline. Parts:

  load       composer trains the folder on one device with SGD; each step's loss
             equals transformers' model trained by torch.optim.SGD on the same
             batches.
  ep_fsdp    the same from a sharded folder under expert_parallel ep 2 then
             fully_shard dp 2 (4 ranks; each rank reads the boxes of its experts
             from the shards).
  export     training under ep 2 x fully_shard dp 2, its step-2 checkpoint (the
             experts sharded over ep) exported as a Mixtral folder: transformers
             loads it with no missing, unexpected or mis-shaped tensor, and its
             loss on step 3's batch is composer's step-3 loss; the step-3
             checkpoint's export is bit-identical to final.safetensors'.
  roundtrip  Hugging Face -> composer (its init.safetensors) -> Hugging Face is
             bit-identical, tensor by tensor, with config.json's fields equal.
  refusals   a missing, mis-shaped or extra expert's tensor, and a dense Llama
             tensor in a Mixtral folder, are refused before launch (exit 2)
             naming the tensor and its file; so is exporting a mixture of experts
             that routes otherwise than Mixtral.

Usage: hf_mixtral.py COMPOSER WORK_DIR PART
"""
import json
import os
import shutil
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools", "reference"))
from reference import Data, load_config  # noqa: E402

COMPOSER, WORK, PART = sys.argv[1], sys.argv[2], sys.argv[3]
VOCAB, LR, STEPS, EXPERTS, TOP_K = 96, 0.1, 3, 4, 2
# float32 on both sides; only summation orders differ (attention kernels, the
# experts' outputs added in another order, matmul blocking): ~1e-7 relative per
# step, measured. A wrong mapping moves the loss by percents.
LOSS_RTOL = 1e-5
# The smallest lead of a token's last chosen expert's router logit over the
# next one's that the test accepts. These models' float32 router logits (up to
# ~8) are within 1.5e-5 of float64's, so two float32 computations differ by at
# most ~3e-5: a lead 30 times that cannot swap an expert in or out. (The seeds
# below give leads of 2.2e-3 to 5.8e-3 over the 3 steps' 768 routings.)
MIN_TOPK_GAP = 1e-3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import EP_FSDP, Harness, norms_away_from_one, save  # noqa: E402

H = Harness("hf_mixtral", COMPOSER, WORK, PART, MixtralForCausalLM, LOSS_RTOL)
fail, composer, run, composer_losses, compare_losses = H.fail, H.composer, H.run, H.composer_losses, H.compare_losses
export, folder_tensors, load_export = H.export, H.folder_tensors, H.load_export


def hf_model(seed=0):
    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           rms_norm_eps=1e-6, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                           initializer_range=0.25, tie_word_embeddings=False)
    model = MixtralForCausalLM(config)
    return norms_away_from_one(model)




def write_config(name, model, mesh="", extra=""):
    return H.write_config(name, model, STEPS, LR, VOCAB, mesh, extra)


def topk_gap(model, x):
    """The smallest gap, over every token of every layer, between the router logits of a token's last chosen and
    first unchosen expert (softmax keeps their order), and the largest logit's magnitude."""
    gaps, peaks = [], []

    def hook(module, inputs, out):
        top = out[0].float().topk(TOP_K + 1, -1).values
        gaps.append((top[:, TOP_K - 1] - top[:, TOP_K]).min().item())
        peaks.append(out[0].abs().max().item())

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=x)
    for h in hooks:
        h.remove()
    return min(gaps), max(peaks)


def batch_loss(model, data, step):
    x, y = data.batch(step, 0, data.global_batch)
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)), x


def train_in_torch(model, run_dir, steps):
    """transformers' model trained by torch.optim.SGD on composer's batches: the losses (and the routing margin)."""
    data = Data(load_config(run_dir), torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, gap, peak = [], float("inf"), 0.0
    for step in range(1, steps + 1):
        loss, x = batch_loss(model, data, step)
        g, p = topk_gap(model, x)
        gap, peak = min(gap, g), max(peak, p)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"router: every token's top-{TOP_K} experts lead the next by at least {gap:.3g} in logits "
          f"(largest logit {peak:.3g})")
    if gap < MIN_TOPK_GAP:
        fail(f"a token's top-{TOP_K} experts lead by only {gap:.3g}: float32 rounding could route it otherwise")
    return losses


def bit_identical(a_dir, b_dir):
    # A folder written without head_dim means hidden_size / num_attention_heads.
    def implied_head_dim(key, want, got):
        return key == "head_dim" and want.get(key) is None and got.get(key) == want["hidden_size"] // want[
            "num_attention_heads"]
    return H.bit_identical(a_dir, b_dir, MixtralConfig,
                           ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                            "tie_word_embeddings", "rope_parameters", "head_dim", "hidden_act", "num_local_experts",
                            "num_experts_per_tok", "router_jitter_noise", "output_router_logits", "sliding_window",
                            "attention_dropout", "architectures", "model_type"), implied_head_dim)


def part_load():
    model = hf_model()
    hf_dir = os.path.join(WORK, "hf")
    save(model, hf_dir)
    config = write_config("load", f"{{name: llama, from_hf: {hf_dir}}}")
    args = json.loads(subprocess.run([COMPOSER, "plan", "--config", config, "--json"], capture_output=True,
                                     text=True, check=True).stdout)["config"]["model"]["args"]
    want = {"n_experts": EXPERTS, "top_k": TOP_K, "moe_hidden_dim": 96, "hidden_dim": 96, "n_shared_experts": 0,
            "score_func": "softmax", "route_norm": True, "route_scale": 1.0, "dim": 64, "n_kv_heads": 2,
            "norm_eps": 1e-6, "rope_theta": 1e6, "max_seq_len": 64, "weight_tying": False}
    got = {k: args.get(k) for k in want}
    if got != want:
        fail(f"composer plan --json gives the Mixtral folder's args as {got}, expected {want}")
    print(f"config.json -> model.args: {got}")
    run_dir = run(config)
    compare_losses(composer_losses(run_dir), train_in_torch(model, run_dir, STEPS), "one device")


def part_ep_fsdp():
    model = hf_model(seed=5)
    hf_dir = os.path.join(WORK, "hf_sharded")
    save(model, hf_dir, shard="100KB")
    shards = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    if len(shards) < 3:
        fail(f"save_pretrained wrote {shards}: the test needs a sharded folder")
    config = write_config("ep_fsdp", f"{{name: llama, from_hf: {hf_dir}}}", mesh=EP_FSDP)
    run_dir = run(config)
    compare_losses(composer_losses(run_dir), train_in_torch(model, run_dir, STEPS),
                   f"expert_parallel ep 2 x fully_shard dp 2 from {len(shards)} shards")


def part_export():
    model = hf_model(seed=3)
    hf_dir = os.path.join(WORK, "hf_export")
    save(model, hf_dir)
    config = write_config("export", f"{{name: llama, from_hf: {hf_dir}}}", mesh=EP_FSDP,
                          extra="checkpoint: {interval: 1}")
    run_dir = run(config)
    losses = composer_losses(run_dir)
    compare_losses(losses, train_in_torch(hf_model(seed=3), run_dir, STEPS), "expert_parallel ep 2 x fully_shard dp 2")
    index = json.load(open(os.path.join(run_dir, "checkpoints", "step-000002", "index.json")))
    chunks = index["tensors"]["layers.0.feed_forward.experts.w1"]["chunks"]
    held = sorted((c["offset"][0], c["size"][0], c["file"]) for c in chunks)
    if [(o, n) for o, n, _ in held] != [(e, 1) for e in range(EXPERTS)] or len({f for *_, f in held}) != EXPERTS:
        fail(f"the step-2 checkpoint holds layers.0.feed_forward.experts.w1 as {held}, not one expert per rank")
    print(f"the step-2 checkpoint holds each expert of layers.0.feed_forward.experts.w1 in another rank's file: "
          f"{[f for *_, f in held]}")
    exported = os.path.join(WORK, "export_step2")
    export(config, exported, "--checkpoint", os.path.join(run_dir, "checkpoints", "step-000002"))
    back = load_export(exported)
    with torch.no_grad():
        loss, _ = batch_loss(back, Data(load_config(run_dir), torch.float32), 3)
    compare_losses([losses[2]], [loss.item()], "step 3 from transformers' load of the step-2 export")
    last = os.path.join(WORK, "export_step3")
    export(config, last, "--checkpoint", os.path.join(run_dir, "checkpoints", "step-000003"))
    final = os.path.join(WORK, "export_final")
    export(config, final, "--weights", os.path.join(run_dir, "final.safetensors"))
    n = bit_identical(final, last)
    print(f"the step-3 checkpoint (experts over ep, fully_shard over dp) exports the {n} tensors of "
          f"final.safetensors bit for bit")


def part_roundtrip():
    hf_dir = os.path.join(WORK, "hf_rt")
    save(hf_model(seed=4), hf_dir)
    config = write_config("rt", f"{{name: llama, from_hf: {hf_dir}}}")
    run_dir = run(config)
    back = os.path.join(WORK, "rt_back")
    export(config, back, "--weights", os.path.join(run_dir, "init.safetensors"))
    n = bit_identical(hf_dir, back)
    load_export(back)
    print(f"Hugging Face -> composer -> Hugging Face: {n} tensors bit-identical, config.json equal")


def part_refusals():
    hf_dir = os.path.join(WORK, "hf_bad")
    save(hf_model(), hf_dir)
    config = write_config("refusals", f"{{name: llama, from_hf: {hf_dir}}}")
    weights = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(weights)
    expert = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    missing = {k: v for k, v in tensors.items() if k != expert}
    misshaped = dict(tensors, **{expert: torch.zeros(64, 64)})
    extra = dict(tensors, **{"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(96, 64)})
    dense = dict(tensors, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64)})
    # (what, the folder's tensors, the message, where it must point)
    for what, folder, message, where in [
            ("missing", missing, f"missing tensor '{expert}'", hf_dir),
            ("mis-shaped", misshaped, f"tensor '{expert}' has shape [64, 64]", weights),
            ("extra expert", extra, "unexpected tensor 'model.layers.0.block_sparse_moe.experts.4.w1.weight': "
                                    "expert 4 of a model with 4 experts", weights),
            ("dense", dense, "unexpected tensor 'model.layers.0.mlp.up_proj.weight'", weights)]:
        save_file(folder, weights, metadata={"format": "pt"})
        out = composer("plan", "--config", config, expect=2)
        if message not in out or where not in out:
            fail(f"a {what} tensor was not refused with '{message}' naming {where}: {out}")
        print(f"{what}:", out.strip().splitlines()[-1])
    args = "{name: llama, args: {dim: 64, n_layers: 1, n_heads: 4, vocab_size: 96, n_experts: 4, top_k: 2, %s}}"
    for setting, message in [("route_norm: true, score_func: sigmoid", "score_func sigmoid"),
                             ("route_norm: false", "route_norm false"),
                             ("route_norm: true, route_scale: 2.0", "route_scale 2.0"),
                             ("route_norm: true, n_shared_experts: 1", "n_shared_experts 1")]:
        cfg = write_config("not_mixtral", args % setting)
        out = composer("export", "--config", cfg, "--weights", "none.safetensors", "--out",
                       os.path.join(WORK, "x"), "--format", "hf", expect=2)
        if message not in out or "use --format pt" not in out:
            fail(f"export --format hf of a mixture of experts with {setting} was not refused naming {message}: {out}")
        print(f"export with {setting}:", out.strip().splitlines()[-1])


os.makedirs(WORK, exist_ok=True)
{"load": part_load, "ep_fsdp": part_ep_fsdp, "export": part_export, "roundtrip": part_roundtrip,
 "refusals": part_refusals}[PART]()
print(f"hf_mixtral {PART}: passed")

#!/usr/bin/env python3
"""Hugging Face DeepSeek-V3 in and out, proven with transformers itself.

Random DeepseekV3ForCausalLM models (multi-head latent attention with a low-rank q (q_lora_rank 32)
and with a plain q_proj (q_lora_rank None); YaRN rope in DeepSeek's interleaved layout; a dense first
layer, then two routed layers of 8 experts in 4 groups (top 2 experts among the best 2 groups, sigmoid
scores plus an e_score_correction_bias drawn in [-0.05, 0.05], weights normalised and scaled by 2.5)
and a shared expert; norms drawn away from one; weights drawn wide, so that a wrong name, a permuted
rotary row, a norm over the wrong span, a wrong softmax scale or routing rule moves the loss by far
more than the tolerance) are saved with save_pretrained, offline, and read as composer's model
deepseek_v3. Parts:

  load       3 SGD steps on one device and under the PLANS below (q_lora_rank 32: all of them;
             q_lora_rank None: tp x fully_shard): each loss equals transformers' model trained by
             torch.optim.SGD on the same batches. The export of the one-device result loads in
             from_pretrained (no missing, unexpected or mis-shaped key) and gives the loss
             transformers' own trained model gives on the last step's batch; the step-2 checkpoint
             of ep x fully_shard (4 ranks, the experts spread over ep) exported and loaded gives
             composer's step-3 loss, with every e_score_correction_bias as the folder had it.
  roundtrip  Hugging Face -> composer (its init.safetensors) -> Hugging Face is bit-identical,
             tensor by tensor, e_score_correction_bias included, with config.json's fields equal.
  refusals   config.json fields composer cannot compute as transformers does (scoring_func other
             than sigmoid, topk_method other than noaux_tc, rope_interleave false, fewer key-value
             heads than heads, attention biases, more than one multi-token prediction layer, FP8
             weights) are refused before launch (exit 2) naming the field; so is a kv_b_proj whose
             shape disagrees with config.json (naming the tensor and its file), and a tensor of a
             layer past the multi-token prediction one (whose tensors are skipped).

Usage: hf_deepseek.py COMPOSER WORK_DIR PART
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import (  # noqa: E402
    CP_ALLTOALL_AC, CP_RING_TP, EP_FSDP, Data, Harness,
    batch_loss, load_config, norms_away_from_one, save)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()

COMPOSER, WORK, PART = sys.argv[1], sys.argv[2], sys.argv[3]
VOCAB, LR, STEPS = 96, 0.1, 3
# float32 on both sides; only summation orders differ (attention kernels, the experts' outputs added in
# another order, sharded reductions): ~1e-7 relative per step. A wrong mapping moves the loss by percents.
LOSS_RTOL = 1e-5
EXPERTS, TOP_K, N_GROUP, TOPK_GROUP = 8, 2, 4, 2
# The smallest lead, in sigmoid scores (plus bias), of a token's last kept group over the first dropped
# one and of its last chosen expert over the first unchosen one, that the test accepts. Two float32
# computations of these models' scores (transformers' and a plain PyTorch MLA, or either and float64)
# differ by at most 2.5e-6, measured; a lead of 1e-4 cannot route a token otherwise. (The seeds below
# give leads of 3.0e-4 to 5.2e-4 over the 3 steps' 768 routings; many seeds give less than 1e-4.)
MIN_ROUTING_GAP = 1e-4
# YaRN as DeepSeek-V3 publishes it (mscale = mscale_all_dim = 1), at a context where its ramp moves some of
# the 4 frequencies of the 8 rotated dims and its softmax scale (1 + 0.1 ln 4)^2 = 1.30 shows.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
# (what, q_lora_rank, a seed whose tokens route with a clear margin (MIN_ROUTING_GAP), how many PLANS)
VARIANTS = [("q_lora_rank 32", 32, 11, 6), ("q_lora_rank None (plain q_proj)", None, 7, 2)]

H = Harness("hf_deepseek", COMPOSER, WORK, PART, DeepseekV3ForCausalLM, LOSS_RTOL)
fail, composer, run, composer_losses, compare_losses = H.fail, H.composer, H.run, H.composer_losses, H.compare_losses
export, folder_tensors, load_export = H.export, H.folder_tensors, H.load_export

PLANS = [("one device", ""),
         ("tp 2 x fully_shard dp 2", """mesh: {shape: [2, 2], names: [dp, tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp}
  - fully_shard: {mesh_dim: dp}"""),
         ("cp 2 (ring) x tp 2", CP_RING_TP),
         ("cp 2 (alltoall) with activation checkpointing", CP_ALLTOALL_AC),
         # 3 layers on 2 stages: the dense layer and the first routed one, then the second routed one.
         ("pp 2 x fully_shard dp 2", """mesh: {shape: [2, 2], names: [pp, dp]}
parallelize:
  - pipeline: {mesh_dim: pp, schedule: 1f1b, split_points: [layers.2]}
  - fully_shard: {mesh_dim: dp, units: [tok_embeddings, layers.*, norm, output]}"""),
         ("ep 2 x fully_shard dp 2", EP_FSDP)]
EP_PLAN = len(PLANS) - 1  # its step-2 checkpoint is exported


def hf_model(q_lora_rank, seed=0):
    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                              num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=EXPERTS, n_shared_experts=1,
                              num_experts_per_tok=TOP_K, n_group=N_GROUP, topk_group=TOPK_GROUP,
                              routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=dict(YARN),
                              max_position_embeddings=64, rope_interleave=True, rms_norm_eps=1e-6,
                              initializer_range=0.25, tie_word_embeddings=False)
    model = norms_away_from_one(DeepseekV3ForCausalLM(config))
    with torch.no_grad():  # transformers draws the bias as zeros; a wrong bias must show
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return model


def biases(tensors):
    return {k: v for k, v in tensors.items() if k.endswith("e_score_correction_bias")}


def write_config(name, hf_dir, mesh="", extra=""):
    return H.write_config(name, "{name: deepseek_v3, from_hf: " + hf_dir + "}", STEPS, LR, VOCAB, mesh, extra)


def routing_gaps(model):
    """Hooks on every router that record, per forward, the smallest lead of a token's last kept group over
    the first dropped one and of its last chosen expert over the first unchosen one (transformers'
    DeepseekV3TopkRouter's float32 math); returns the list they append to and the hooks."""
    gaps = []

    def hook(router, inputs, _out):
        with torch.no_grad():
            x = inputs[0].reshape(-1, router.weight.size(1)).float()
            choose = torch.sigmoid(F.linear(x, router.weight.float())) + router.e_score_correction_bias
            groups = choose.view(-1, N_GROUP, EXPERTS // N_GROUP).topk(2, dim=-1).values.sum(-1)
            top = groups.topk(TOPK_GROUP + 1, dim=-1).values
            group_gap = (top[:, TOPK_GROUP - 1] - top[:, TOPK_GROUP]).min().item()
            kept = groups.topk(TOPK_GROUP, dim=-1).indices
            dropped = torch.ones_like(groups, dtype=torch.bool).scatter(1, kept, False)
            choose = choose.view(-1, N_GROUP, EXPERTS // N_GROUP).masked_fill(dropped.unsqueeze(-1), float("-inf"))
            top = choose.view(-1, EXPERTS).topk(TOP_K + 1, dim=-1).values
            gaps.append((group_gap, (top[:, TOP_K - 1] - top[:, TOP_K]).min().item()))

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    return gaps, hooks


def train_in_torch(model, run_dir):
    """transformers' model trained in place by torch.optim.SGD on composer's batches: the losses. Fails when a
    token's routing wins by less than MIN_ROUTING_GAP (float32 rounding could route it otherwise)."""
    data = Data(load_config(run_dir), torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gaps, hooks = routing_gaps(model)
    losses = []
    for step in range(1, STEPS + 1):
        loss = batch_loss(model, data, step)[0]
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for h in hooks:
        h.remove()
    group_gap, expert_gap = min(g for g, _ in gaps), min(e for _, e in gaps)
    print(f"router: every token's top-{TOPK_GROUP} groups lead the next by at least {group_gap:.3g} and its top-"
          f"{TOP_K} experts among them by at least {expert_gap:.3g} (sigmoid scores plus bias)")
    if min(group_gap, expert_gap) < MIN_ROUTING_GAP:
        fail(f"a token's routing wins by only {min(group_gap, expert_gap):.3g}: float32 rounding could route it "
             "otherwise")
    return losses


def check_args(config, q_lora_rank):
    """config.json read into model.args as composer's plan --json gives them."""
    args = json.loads(subprocess.run([COMPOSER, "plan", "--config", config, "--json"], capture_output=True, text=True,
                                     check=True).stdout)["config"]["model"]["args"]
    want = {"dim": 64, "n_layers": 3, "n_heads": 4, "vocab_size": VOCAB, "hidden_dim": 96, "norm_eps": 1e-6,
            "max_seq_len": 64, "weight_tying": False, "q_lora_rank": q_lora_rank or 0, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_experts": EXPERTS,
            "top_k": TOP_K, "n_dense_layers": 1, "moe_hidden_dim": 32, "n_shared_experts": 1,
            "score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "n_group": N_GROUP,
            "topk_group": TOPK_GROUP, "expert_bias": True, "rope_type": "yarn", "rope_theta": 10000.0,
            "rope_factor": 4.0, "rope_original_max_seq_len": 16, "rope_mscale": 1.0, "rope_mscale_all_dim": 1.0}
    got = {k: args.get(k) for k in want}
    if got != want:
        fail(f"composer plan --json gives the DeepSeek-V3 folder's args as {got}, expected {want}")
    print(f"config.json -> model.args: {got}")


def part_load():
    for what, q_lora_rank, seed, n_plans in VARIANTS:
        hf_dir = os.path.join(WORK, f"hf_q{q_lora_rank}")
        save(hf_model(q_lora_rank, seed), hf_dir)
        want = None
        for i, (plan, mesh) in enumerate(PLANS[:n_plans]):
            config = write_config(f"load_q{q_lora_rank}_{i}", hf_dir, mesh,
                                  "checkpoint: {interval: 2}" if i == EP_PLAN else "")
            if i == 0:
                check_args(config, q_lora_rank)
            run_dir = run(config)
            data = Data(load_config(run_dir), torch.float32)
            losses = composer_losses(run_dir)
            if want is None:
                trained = hf_model(q_lora_rank, seed)
                want = train_in_torch(trained, run_dir)
            compare_losses(losses, want, f"{what}, {plan}")
            if i == 0:  # the trained model back in transformers: its loss on the last step's batch
                exported = os.path.join(WORK, f"export_q{q_lora_rank}")
                export(config, exported, "--weights", os.path.join(run_dir, "final.safetensors"))
                with torch.no_grad():
                    after = batch_loss(load_export(exported), data, STEPS)[0].item()
                    theirs = batch_loss(trained, data, STEPS)[0].item()
                compare_losses([after], [theirs], f"{what}, transformers' load of the trained export")
            if i == EP_PLAN:  # the step-2 checkpoint of 4 ranks, exported and loaded by transformers
                exported = os.path.join(WORK, f"export_q{q_lora_rank}_ep_fsdp")
                export(config, exported, "--checkpoint", os.path.join(run_dir, "checkpoints", "step-000002"))
                want_bias, got_bias = biases(folder_tensors(hf_dir)), biases(folder_tensors(exported))
                if sorted(want_bias) != sorted(got_bias) or not all(
                        torch.equal(want_bias[k], got_bias[k]) for k in want_bias):
                    fail(f"the export of the step-2 checkpoint of {plan} holds e_score_correction_bias "
                         f"{got_bias}, the folder {want_bias}")
                with torch.no_grad():
                    loss = batch_loss(load_export(exported), data, STEPS)[0].item()
                compare_losses([losses[STEPS - 1]], [loss], f"{what}, step {STEPS} from transformers' load of the "
                               f"step-2 export of {plan} ({len(want_bias)} expert biases bit-identical)")


def bit_identical(a_dir, b_dir):
    # num_nextn_predict_layers is not compared: save_pretrained writes transformers' default 1 without any
    # multi-token-prediction layer, which composer neither reads nor writes.
    return H.bit_identical(a_dir, b_dir, DeepseekV3Config, (
        "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        "rope_parameters", "rope_interleave", "hidden_act", "attention_bias", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
        "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
        "first_k_dense_replace", "architectures", "model_type"))


def part_roundtrip():
    for what, q_lora_rank, seed, _ in VARIANTS:
        hf_dir = os.path.join(WORK, f"hf_rt_q{q_lora_rank}")
        save(hf_model(q_lora_rank, seed + 10), hf_dir)
        H.roundtrip(hf_dir, write_config(f"rt_q{q_lora_rank}", hf_dir), f"q_lora_rank_{q_lora_rank}", bit_identical)
        n = len(biases(folder_tensors(hf_dir)))
        if n != 2:
            fail(f"{hf_dir} holds {n} e_score_correction_bias tensors, expected one per routed layer (2)")
        print(f"{what}: the {n} e_score_correction_bias tensors among them")


def part_refusals():
    hf_dir = os.path.join(WORK, "hf_bad")
    save(hf_model(32), hf_dir)
    config = write_config("refusals", hf_dir)
    composer("plan", "--config", config)  # the folder as saved is accepted
    path = os.path.join(hf_dir, "config.json")
    original = json.load(open(path))
    # (the config.json field, a value composer cannot compute as transformers does)
    for field, value in [("scoring_func", "softmax"), ("topk_method", "greedy"), ("rope_interleave", False),
                         ("num_key_value_heads", 2), ("attention_bias", True), ("num_nextn_predict_layers", 2),
                         ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3",
                                                  "weight_block_size": [128, 128]})]:
        with open(path, "w") as f:
            json.dump(dict(original, **{field: value}), f, indent=2)
        out = composer("plan", "--config", config, expect=2)
        if field not in out:
            fail(f"config.json {field}: {json.dumps(value)} was not refused naming {field}: {out}")
        print(f"{field}: {json.dumps(value)}:", out.strip().splitlines()[-1])
    with open(path, "w") as f:
        json.dump(original, f, indent=2)
    weights = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(weights)
    # The released folders' multi-token prediction layer (model.layers.<num_hidden_layers>.*) is skipped, as
    # transformers skips it; a tensor of a layer past it means more layers than config.json builds.
    mtp = "model.layers.3.eh_proj.weight"
    save_file(dict(tensors, **{mtp: torch.zeros(64, 128)}), weights, metadata={"format": "pt"})
    planned = composer("plan", "--config", config)
    if f"plan: from_hf: 1 tensor of {hf_dir} not read" not in planned or mtp not in planned:
        fail(f"composer plan of a folder with {mtp} did not say it is not read: {planned}")
    out = composer("run", "--config", config, "--set", "train.steps=1", "--out", os.path.join(WORK, "mtp_run"))
    note = [line for line in out.splitlines() if "not read" in line]
    if not note or "1 tensor of" not in note[0] or mtp not in note[0]:
        fail(f"a run skipping {mtp} did not say so: {out}")
    print(f"{mtp} (the multi-token prediction layer): skipped:", note[0].strip())
    beyond = "model.layers.4.input_layernorm.weight"
    save_file(dict(tensors, **{beyond: torch.ones(64)}), weights, metadata={"format": "pt"})
    out = composer("plan", "--config", config, expect=2)
    if beyond not in out:
        fail(f"a tensor of layer 4 in a 3-layer folder was not refused naming {beyond}: {out}")
    print("a layer past the multi-token prediction one:", out.strip().splitlines()[-1])
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # [4 x (16 + 16), 32]; as if v_head_dim were 8
    save_file(dict(tensors, **{name: torch.zeros(4 * (16 + 8), 32)}), weights, metadata={"format": "pt"})
    out = composer("plan", "--config", config, expect=2)
    if name not in out or weights not in out:
        fail(f"a kv_b_proj of another shape than config.json's was not refused naming {name} and {weights}: {out}")
    print("mis-shaped kv_b_proj:", out.strip().splitlines()[-1])


os.makedirs(WORK, exist_ok=True)
{"load": part_load, "roundtrip": part_roundtrip, "refusals": part_refusals}[PART]()
print(f"hf_deepseek {PART}: passed")

#!/usr/bin/env python3
"""Hugging Face Qwen3 in and out, proven with transformers itself.

Random Qwen3ForCausalLM models (grouped-query attention, a head_dim of 32 against hidden 64 / 4 heads,
per-head q and k RMSNorms drawn away from one, tied and untied) are saved with save_pretrained,
offline, and read as composer's model qwen3. Parts:

  load       3 SGD steps on one device and under the PLANS below (tied: all four; untied: tp x
             fully_shard), among them tensor_parallel, where the q and k norms act on each rank's own
             heads and their gradients are summed over tp: each loss equals transformers' model
             trained by torch.optim.SGD on the same batches. The export of the one-device result
             loads in from_pretrained (no missing, unexpected or mis-shaped key) and gives the loss
             transformers' own trained model gives on the last step's batch; the step-2 checkpoint
             of tp x fully_shard (4 ranks) exported and loaded gives composer's step-3 loss.
  roundtrip  Hugging Face -> composer (its init.safetensors) -> Hugging Face is bit-identical, tensor
             by tensor (the q/k norm weights permuted with their heads' rows and back), tied and untied.

  moe        Qwen3-MoE (model_type qwen3_moe) read into model qwen3 with its experts: see part_moe.

Usage: hf_qwen3.py COMPOSER WORK_DIR PART
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import (  # noqa: E402
    CP_ALLTOALL_AC, CP_RING_TP, EP_FSDP, Data, Harness,
    batch_loss, load_config, norms_away_from_one, save, sgd_losses)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

COMPOSER, WORK, PART = sys.argv[1], sys.argv[2], sys.argv[3]
VOCAB, LR, STEPS = 96, 0.1, 3
LOSS_RTOL = 1e-5  # float32 on both sides; summation orders differ (~1e-7 relative per step)

H = Harness("hf_qwen3", COMPOSER, WORK, PART, Qwen3ForCausalLM, LOSS_RTOL)
fail, run, composer_losses, compare_losses = H.fail, H.run, H.composer_losses, H.compare_losses
export, load_export = H.export, H.load_export

PLANS = [("one device", ""),
         ("tp 2 (sequence parallel) x fully_shard dp 2", """mesh: {shape: [2, 2], names: [dp, tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp, sequence_parallel: true}
  - fully_shard: {mesh_dim: dp}"""),
         ("cp 2 (ring) x tp 2", CP_RING_TP),
         ("cp 2 (alltoall) with activation checkpointing", CP_ALLTOALL_AC),
         ("pp 2 x fully_shard dp 2", """mesh: {shape: [2, 2], names: [pp, dp]}
parallelize:
  - pipeline: {mesh_dim: pp, schedule: 1f1b, layers_per_stage: 1}
  - fully_shard: {mesh_dim: dp, units: [tok_embeddings, layers.*, norm, output]}""")]


def hf_model(tied, seed=0):
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied, initializer_range=0.25)
    return norms_away_from_one(Qwen3ForCausalLM(config))


def write_config(name, hf_dir, mesh=""):
    return H.write_config(name, "{name: qwen3, from_hf: " + hf_dir + "}", STEPS, LR, VOCAB, mesh)


def train_in_torch(model, run_dir, steps):
    return sgd_losses(model, run_dir, steps, LR)


def part_load():
    for tied in (True, False):
        tag = "tied" if tied else "untied"
        hf_dir = os.path.join(WORK, f"hf_{tag}")
        save(hf_model(tied), hf_dir)
        want = None
        for i, (what, mesh) in enumerate(PLANS if tied else PLANS[:2]):
            config = write_config(f"load_{tag}_{i}", hf_dir, mesh)
            if i == 1:  # tp x fully_shard: a checkpoint at step 2 to export
                with open(config, "a") as f:
                    f.write("checkpoint: {interval: 2}\n")
            run_dir = run(config)
            if want is None:
                want = train_in_torch(hf_model(tied), run_dir, STEPS)
            losses = composer_losses(run_dir)
            compare_losses(losses, want, f"{tag}, {what}")
            if i == 1:  # the step-2 checkpoint of 4 ranks, exported and loaded by transformers: step 3's loss
                exported = os.path.join(WORK, f"export_{tag}_tp_fsdp")
                export(config, exported, "--checkpoint", os.path.join(run_dir, "checkpoints", "step-000002"))
                with torch.no_grad():
                    loss = batch_loss(load_export(exported), Data(load_config(run_dir), torch.float32), STEPS)[0]
                compare_losses([losses[STEPS - 1]], [loss.item()],
                               f"{tag}, step {STEPS} from transformers' load of the step-2 export of tp x fully_shard")
            if i == 0:  # the trained model back in transformers: its loss at the last step's batch
                exported = os.path.join(WORK, f"export_{tag}")
                export(config, exported, "--weights", os.path.join(run_dir, "final.safetensors"))
                back = load_export(exported)
                with torch.no_grad():
                    after = batch_loss(back, Data(load_config(run_dir), torch.float32), STEPS)[0].item()
                trained = hf_model(tied)
                train_in_torch(trained, run_dir, STEPS)
                with torch.no_grad():
                    theirs = batch_loss(trained, Data(load_config(run_dir), torch.float32), STEPS)[0].item()
                compare_losses([after], [theirs], f"{tag}, transformers' load of the trained export")


EXPERTS, TOP_K = 4, 2
MOE_SEED = 3  # a draw whose tokens route with a clear margin (MIN_TOPK_GAP)
# (norm_topk_prob, decoder_sparse_step, mlp_only_layers, a seed whose tokens route with a clear margin)
VARIANTS = [(True, 1, [], MOE_SEED), (False, 1, [], MOE_SEED), (True, 2, [1], 5)]
# A token whose top-k experts lead the next by less than this could route otherwise under another
# summation order (float32 router logits agree with float64's to about 1e-5 here).
MIN_TOPK_GAP = 1e-3


def moe_model(norm_topk_prob, step=1, mlp_only=(), seed=MOE_SEED):
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                            num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob,
                            decoder_sparse_step=step, mlp_only_layers=list(mlp_only), num_hidden_layers=2 * step, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            initializer_range=0.25)
    return norms_away_from_one(Qwen3MoeForCausalLM(config))


def topk_gap(model, run_dir):
    """The smallest lead, over every token of every layer and every step's batch of transformers' training,
    of a token's last chosen expert over the first unchosen one, in router logits."""
    gaps, inputs = [], []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: inputs.append((m, i[0]))) for layer in
             model.model.layers if hasattr(layer.mlp, "gate")]
    data = Data(load_config(run_dir), torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(1, STEPS + 1):
        inputs.clear()
        loss = batch_loss(model, data, step)[0]
        with torch.no_grad():
            for m, x in inputs:
                top = F.linear(x.reshape(-1, x.size(-1)), m.weight).topk(TOP_K + 1, -1).values
                gaps.append((top[:, TOP_K - 1] - top[:, TOP_K]).min().item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for h in hooks:
        h.remove()
    return min(gaps)


def part_moe():
    """Qwen3-MoE (softmax routing, top 2 of 4, the top-k weights divided by their sum or not; and with
    decoder_sparse_step 2 and mlp_only_layers [1], layers 0-2 dense and layer 3 routed): losses against transformers on one device,
    under expert_parallel ep 2 x fully_shard dp 2 and under tensor_parallel tp 2 (attention and the dense
    layers split, the experts whole on each tp rank); the step-2 checkpoint of ep x fully_shard exported,
    loaded by transformers, gives composer's step-3 loss; the round trip is bit-identical."""
    for norm, step, mlp_only, seed in VARIANTS:
        tag = f"norm_topk_prob {str(norm).lower()}, decoder_sparse_step {step}, mlp_only_layers {mlp_only}"
        hf_dir = os.path.join(WORK, f"hf_moe_{norm}_{step}")
        save(moe_model(norm, step, mlp_only, seed), hf_dir)
        want = None
        for i, (what, mesh) in enumerate([("one device", ""), ("ep 2 x fully_shard dp 2", EP_FSDP),
                                          ("tp 2", "mesh: {shape: [2], names: [tp]}\nparallelize:\n"
                                                   "  - tensor_parallel: {mesh_dim: tp}")]):
            config = H.write_config(f"moe_{norm}_{step}_{i}", "{name: qwen3, from_hf: " + hf_dir + "}", STEPS, LR, VOCAB,
                                    mesh, "checkpoint: {interval: 2}" if i == 1 else "")
            run_dir = run(config)
            if want is None:
                want = train_in_torch(moe_model(norm, step, mlp_only, seed), run_dir, STEPS)
                gap = topk_gap(moe_model(norm, step, mlp_only, seed), run_dir)
                print(f"{tag}: every token's top-{TOP_K} experts lead the next by at least {gap:.3g} in logits")
                if gap < MIN_TOPK_GAP:
                    fail(f"a token's top-{TOP_K} experts lead by only {gap:.3g}: float32 rounding could route it "
                         "otherwise")
            losses = composer_losses(run_dir)
            compare_losses(losses, want, f"{tag}, {what}")
            if i == 0:
                H.roundtrip(hf_dir, config, f"moe_{norm}_{step}", lambda a, b: H.bit_identical(
                    a, b, Qwen3MoeConfig, ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                           "intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                           "mlp_only_layers", "head_dim", "hidden_size", "num_hidden_layers",
                                           "rope_parameters")))
            if i == 1:
                exported = os.path.join(WORK, f"moe_export_{norm}_{step}")
                export(config, exported, "--checkpoint", os.path.join(run_dir, "checkpoints", "step-000002"))
                back = H.load_export(exported, Qwen3MoeForCausalLM)
                with torch.no_grad():
                    loss = batch_loss(back, Data(load_config(run_dir), torch.float32), STEPS)[0].item()
                compare_losses([losses[STEPS - 1]], [loss], f"{tag}, step {STEPS} from transformers' load of the "
                               "step-2 export of ep x fully_shard")


def part_roundtrip():
    for tied in (False, True):
        tag = "tied" if tied else "untied"
        hf_dir = os.path.join(WORK, f"hf_rt_{tag}")
        save(hf_model(tied, seed=2), hf_dir)
        H.roundtrip(hf_dir, write_config(f"rt_{tag}", hf_dir), tag, lambda a, b: H.bit_identical(
            a, b, Qwen3Config, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                                "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "hidden_act",
                                "use_sliding_window", "layer_types")))


os.makedirs(WORK, exist_ok=True)
{"load": part_load, "roundtrip": part_roundtrip, "moe": part_moe}[PART]()
print(f"hf_qwen3 {PART}: passed")

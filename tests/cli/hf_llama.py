#!/usr/bin/env python3
"""Hugging Face Llama in and out, proven with transformers itself.

Random LlamaForCausalLM models (grouped-query attention, tied and untied,
weights drawn wide enough that a wrong rotary order or name moves the loss by
far more than the tolerance) are saved with save_pretrained, offline. Parts:

  load       composer trains the folder on one device with SGD; each step's loss
             equals transformers' model trained by torch.optim.SGD on the same
             batches, and transformers loads composer's export of the result
             (no missing, unexpected or mismatched keys) with the same logits.
  plan3d     the same folder under tensor_parallel x fully_shard x pipeline
             (dp 2, tp 2, pp 2); the export of the step-2 checkpoint, loaded by
             transformers, gives composer's step-3 loss on step 3's batch.
  roundtrip  Hugging Face -> composer (its init.safetensors) -> Hugging Face is
             bit-identical, tensor by tensor, tied and untied.
  fsdp       the same from a sharded folder under fully_shard dp 2 (each rank
             reads its pieces from the shards), exported in shards again.
  rope       Llama 3.1+'s llama3 rope scaling (tied, as Llama 3.2) and YaRN:
             losses equal transformers' on one device and under tp 2 x cp 2
             ring, cp 2 alltoall and pp 2 x fully_shard dp 2 (whose step-2
             checkpoint, exported and loaded by transformers, gives step 3's
             loss); the round trip is bit-identical.
  refusals   a missing or mis-shaped tensor is refused before launch (exit 2)
             naming the tensor and its file.

Usage: hf_llama.py COMPOSER WORK_DIR PART
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
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools", "reference"))
from reference import Data, load_config  # noqa: E402

COMPOSER, WORK, PART = sys.argv[1], sys.argv[2], sys.argv[3]
VOCAB, LR, STEPS = 96, 0.1, 3
# float32 on both sides; summation orders differ (~1e-7 relative per step).
LOSS_RTOL = 1e-5

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import Harness, batch_loss, norms_away_from_one, save, sgd_losses  # noqa: E402

H = Harness("hf_llama", COMPOSER, WORK, PART, LlamaForCausalLM, LOSS_RTOL)
fail, composer, run, composer_losses, compare_losses = H.fail, H.composer, H.run, H.composer_losses, H.compare_losses
export, folder_tensors, load_export = H.export, H.folder_tensors, H.load_export


# Rope scaling as Llama 3.1-3.3 publish it (llama3) and YaRN, at a context where each band of each moves
# the 8 frequencies of a 16-dim head: llama3 keeps wavelengths below 32/4 (one pair), scales those above 32
# (five) and blends between (two); yarn at theta 100 keeps pair 0, blends pair 1 and scales the rest, and
# multiplies cos and sin by 0.1 ln 4 + 1.
ROPE = {"llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        "yarn": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32.0, "beta_slow": 1.0}}


def hf_model(tied, seed=0, rope=None):
    torch.manual_seed(seed)
    extra = {"rope_parameters": dict(ROPE[rope])} if rope else {}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=tied, initializer_range=0.25, **extra)
    model = LlamaForCausalLM(config)
    return norms_away_from_one(model)


def write_config(name, hf_dir, mesh="", extra=""):
    return H.write_config(name, "{name: llama, from_hf: " + hf_dir + "}", STEPS, LR, VOCAB, mesh, extra)


def train_in_torch(model, run_dir, steps, dtype=torch.float32):
    """transformers' model trained by torch.optim.SGD on composer's batches: the losses."""
    return sgd_losses(model, run_dir, steps, LR, dtype)


def bit_identical(a_dir, b_dir):
    return H.bit_identical(a_dir, b_dir, LlamaConfig,
                           ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                            "tie_word_embeddings", "rope_parameters", "head_dim", "hidden_act"))


def part_load():
    for tied in (False, True):
        tag = "tied" if tied else "untied"
        model = hf_model(tied)
        exact = hf_model(tied).double()  # the same model in float64: what float32 rounding is measured against
        hf_dir = os.path.join(WORK, f"hf_{tag}")
        save(model, hf_dir)
        config = write_config(f"load_{tag}", hf_dir)
        run_dir = run(config)
        compare_losses(composer_losses(run_dir), train_in_torch(model, run_dir, STEPS), f"one device, {tag}")
        train_in_torch(exact, run_dir, STEPS, torch.float64)
        exported = os.path.join(WORK, f"export_{tag}")
        export(config, exported, "--weights", os.path.join(run_dir, "final.safetensors"))
        back = load_export(exported)
        if tied and back.lm_head.weight.data_ptr() != back.model.embed_tokens.weight.data_ptr():
            fail("transformers did not tie lm_head to embed_tokens in the export of a tied model")
        # After training, float32 rounding (amplified by the steps) is of the
        # order of 1e-5 of the largest logit on either side: composer's logits
        # must be as close to the float64 training's as transformers' own are.
        data = Data(load_config(run_dir), torch.float32)
        with torch.no_grad():
            _, ref = batch_loss(exact, Data(load_config(run_dir), torch.float64), 1)
            _, theirs = batch_loss(model, data, 1)
            _, ours = batch_loss(back, data, 1)
        scale = ref.abs().max()
        err, their_err = [((x.double() - ref).abs().max() / scale).item() for x in (ours, theirs)]
        print(f"{tag}: logits after {STEPS} steps against float64 training, max abs err / max abs: composer's "
              f"export {err:.3g}, transformers in float32 {their_err:.3g}")
        if err > 2 * their_err + 1e-7:
            fail(f"{tag}: the exported model's logits are {err:.3g} from float64 training's, transformers' "
                 f"{their_err:.3g}")


def part_plan3d():
    model = hf_model(False, seed=1)
    hf_dir = os.path.join(WORK, "hf_3d")
    save(model, hf_dir)
    config = write_config("plan3d", hf_dir, mesh="""mesh: {shape: [2, 2, 2], names: [pp, dp, tp]}
parallelize:
  - pipeline: {mesh_dim: pp, schedule: 1f1b, layers_per_stage: 1}
  - tensor_parallel: {mesh_dim: tp}
  - fully_shard: {mesh_dim: dp, units: [tok_embeddings, layers.*, norm, output]}""",
                          extra="checkpoint: {interval: 2}")
    run_dir = run(config)
    losses = composer_losses(run_dir)
    compare_losses(losses, train_in_torch(hf_model(False, seed=1), run_dir, STEPS), "dp 2 x tp 2 x pp 2")
    exported = os.path.join(WORK, "export_3d")
    export(config, exported, "--checkpoint", os.path.join(run_dir, "checkpoints", "step-000002"))
    back = load_export(exported)
    with torch.no_grad():
        loss, _ = batch_loss(back, Data(load_config(run_dir), torch.float32), 3)
    compare_losses([losses[2]], [loss.item()], "step 3 from transformers' load of the step-2 export")


def part_roundtrip():
    for tied in (False, True):
        tag = "tied" if tied else "untied"
        hf_dir = os.path.join(WORK, f"hf_rt_{tag}")
        save(hf_model(tied, seed=2), hf_dir)
        H.roundtrip(hf_dir, write_config(f"rt_{tag}", hf_dir), tag, bit_identical)


def part_fsdp():
    model = hf_model(False, seed=4)
    hf_dir = os.path.join(WORK, "hf_sharded")
    save(model, hf_dir, shard="40KB")
    shards = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
    if len(shards) < 3 or not os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json")):
        fail(f"save_pretrained wrote {shards}: the test needs a sharded folder")
    config = write_config("fsdp_dp2", hf_dir, mesh="""mesh: {shape: [2], names: [dp]}
parallelize:
  - fully_shard: {mesh_dim: dp}""")
    run_dir = run(config)
    compare_losses(composer_losses(run_dir), train_in_torch(model, run_dir, STEPS), "fully_shard dp 2 from shards")
    back = os.path.join(WORK, "fsdp_back")
    export(config, back, "--weights", os.path.join(run_dir, "init.safetensors"), shard="40KB")
    if not os.path.exists(os.path.join(back, "model.safetensors.index.json")):
        fail("the export of a model above --max-shard-size is not sharded")
    n = bit_identical(hf_dir, back)
    load_export(back)
    print(f"{len(shards)} shards -> fully_shard dp 2 -> Hugging Face: {n} tensors bit-identical")
    # The same weights in composer's names (model.init_from), each rank reading its pieces: the same run.
    same = write_config("fsdp_dp2_init_from", hf_dir, mesh="""mesh: {shape: [2], names: [dp]}
parallelize:
  - fully_shard: {mesh_dim: dp}""")
    text = open(same).read().replace(f"from_hf: {hf_dir}",
                                     "args: {dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, vocab_size: 96, "
                                     "hidden_dim: 96, max_seq_len: 64, norm_eps: 1.0e-6}, init_from: "
                                     + os.path.join(run_dir, "init.safetensors"))
    open(same, "w").write(text)
    again = run(same)
    if composer_losses(again) != composer_losses(run_dir):
        fail(f"init_from of the same weights trained {composer_losses(again)}, from_hf {composer_losses(run_dir)}")
    print("the same weights as init_from (composer's names) under fully_shard dp 2: the same losses, bit for bit")


def part_rope():
    """Llama 3.2's layout (llama3 rope scaling, tied) and YaRN: the losses equal transformers' on one device and
    under three plans (tp 2 with sequence parallelism x cp 2 ring, cp 2 alltoall, pp 2 x fully_shard dp 2), and
    the folder comes back bit for bit with its rope_parameters."""
    for rope, tied in (("llama3", True), ("yarn", False)):
        hf_dir = os.path.join(WORK, f"hf_{rope}")
        save(hf_model(tied, seed=5, rope=rope), hf_dir)
        got = json.load(open(os.path.join(hf_dir, "config.json")))["rope_parameters"]
        if got.get("rope_type") != rope:
            fail(f"transformers wrote rope_parameters {got}: the test needs rope_type {rope}")
        plans = [("one device", "")]
        plans.append(("tp 2 x cp 2 (ring)", """mesh: {shape: [2, 2], names: [cp, tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp, sequence_parallel: true}
  - context_parallel: {mesh_dim: cp}"""))
        plans.append(("cp 2 (alltoall)", """mesh: {shape: [2], names: [cp]}
parallelize:
  - context_parallel: {mesh_dim: cp, rotate: alltoall}"""))
        plans.append(("pp 2 x fully_shard dp 2", """mesh: {shape: [2, 2], names: [pp, dp]}
parallelize:
  - pipeline: {mesh_dim: pp, schedule: 1f1b, layers_per_stage: 1}
  - fully_shard: {mesh_dim: dp, units: [tok_embeddings, layers.*, norm, output]}"""))
        for i, (what, mesh) in enumerate(plans):
            last = i == len(plans) - 1  # pp x fully_shard: a checkpoint at step 2 to export
            config = write_config(f"{rope}_{i}", hf_dir, mesh=mesh, extra="checkpoint: {interval: 2}" if last else "")
            run_dir = run(config)
            losses = composer_losses(run_dir)
            compare_losses(losses, train_in_torch(hf_model(tied, seed=5, rope=rope), run_dir, STEPS), f"{rope}, {what}")
            if last:  # the step-2 checkpoint of 4 ranks, exported and loaded by transformers: step 3's loss
                exported = os.path.join(WORK, f"{rope}_export_pp_fsdp")
                export(config, exported, "--checkpoint", os.path.join(run_dir, "checkpoints", "step-000002"))
                with torch.no_grad():
                    loss, _ = batch_loss(load_export(exported), Data(load_config(run_dir), torch.float32), STEPS)
                compare_losses([losses[STEPS - 1]], [loss.item()],
                               f"{rope}, step {STEPS} from transformers' load of the step-2 export of pp x fully_shard")
            if i == 0:
                back = os.path.join(WORK, f"{rope}_back")
                export(config, back, "--weights", os.path.join(run_dir, "init.safetensors"))
                n = bit_identical(hf_dir, back)
                print(f"{rope}: Hugging Face -> composer -> Hugging Face: {n} tensors bit-identical, "
                      f"rope_parameters {json.load(open(os.path.join(back, 'config.json')))['rope_parameters']}")


def part_refusals():
    from safetensors.torch import save_file
    hf_dir = os.path.join(WORK, "hf_bad")
    save(hf_model(False), hf_dir)
    config = write_config("refusals", hf_dir)
    weights = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(weights)
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    misshaped = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    bias = dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    # (what, the folder's tensors, the message, where it must point)
    for what, folder, message, where in [
            ("missing", missing, "missing tensor 'model.layers.1.mlp.up_proj.weight'", hf_dir),
            ("mis-shaped", misshaped, "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [64, 64]", weights),
            ("unexpected", bias, "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'", weights)]:
        save_file(folder, weights, metadata={"format": "pt"})
        out = composer("plan", "--config", config, expect=2)
        if message not in out or where not in out:
            fail(f"a {what} tensor was not refused with '{message}' naming {where}: {out}")
        print(f"{what}:", out.strip().splitlines()[-1])


os.makedirs(WORK, exist_ok=True)
{"load": part_load, "plan3d": part_plan3d, "roundtrip": part_roundtrip, "fsdp": part_fsdp, "rope": part_rope,
 "refusals": part_refusals}[PART]()
print(f"hf_llama {PART}: passed")

#!/usr/bin/env python3
"""LoRA (train.lora) against transformers + peft, and composer's PEFT export loaded by peft.

A random LlamaForCausalLM (grouped-query attention, norms drawn away from one) is saved with
save_pretrained, offline, and read with from_hf; composer trains rank-4 adapters on every attention
and MLP projection (wq and wk among them, whose rows the Hugging Face layout permutes) for 3 SGD
steps, on one device and under tp 2 (sequence parallel) x fully_shard dp 2.

- `composer export --format peft` of the run's initial weights is loaded by
  peft.PeftModel.from_pretrained on the Hugging Face base, with every adapter key the model has in
  the file and none else; peft's model, trained by torch.optim.SGD on composer's batches, gives
  composer's losses step by step (float32).
- The export of the one-device run's final weights equals peft's trained adapters, and the model
  peft loads from it gives peft's trained model's loss.
- The 4-rank run's step-3 checkpoint, exported, gives the same adapters as the one-device run; exported
  with --format hf --merge, transformers loads it (no missing or unexpected key), its weights equal
  peft's merge_and_unload of the trained adapters and it gives peft's trained model's loss.
- model.lora_from: the 4-rank plan continues from the folder peft's save_pretrained wrote of its trained
  model, and its losses equal peft's own SGD steps from there; an adapter of another base, and one whose
  r differs from train.lora.rank, are refused (exit 2, naming model.lora_from).
- Without train.lora, --format peft and --merge are refused, and a LoRA run's pt export without --merge
  (exit 2).

Usage: hf_lora.py COMPOSER WORK_DIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import Data, Harness, batch_loss, load_config, norms_away_from_one, save, sgd_losses  # noqa: E402

import torch  # noqa: E402
from peft import PeftModel, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

COMPOSER, WORK = sys.argv[1], sys.argv[2]
VOCAB, LR, STEPS = 96, 0.5, 3
LOSS_RTOL = 1e-5  # float32 on both sides; summation orders differ (~1e-7 relative per step)
PARAM_ATOL = 1e-5  # adapters after 3 SGD steps, float32 (values ~1e-2 to 1)
LORA = ("{rank: 4, alpha: 8, targets: [layers.*.attention.wq, layers.*.attention.wk, layers.*.attention.wv, "
        "layers.*.attention.wo, layers.*.feed_forward]}")
TP_FSDP = """mesh: {shape: [2, 2], names: [dp, tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp, sequence_parallel: true}
  - fully_shard: {mesh_dim: dp}"""

H = Harness("hf_lora", COMPOSER, WORK, "lora", LlamaForCausalLM, LOSS_RTOL)
fail = H.fail


def base_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.25)
    return norms_away_from_one(LlamaForCausalLM(config))


def with_lora(config):
    """The harness's config with train.lora in its train section."""
    text = open(config).read().replace("  loss: {name: cross_entropy}", f"  lora: {LORA}\n  loss: {{name: cross_entropy}}")
    open(config, "w").write(text)
    return config


def peft_export(config, out, *source):
    print(H.composer("export", "--config", config, *source, "--out", out, "--format", "peft").strip())
    return out


def load_peft(hf_dir, folder, trainable=False):
    """peft's model of `folder` on the Hugging Face base, with every adapter key the model has in the file
    and none else."""
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir), folder, is_trainable=trainable)
    want = set(get_peft_model_state_dict(model))
    have = set(load_file(os.path.join(folder, "adapter_model.safetensors")))
    if want != have or not want:
        fail(f"peft's model of {folder} holds adapters {sorted(want - have)[:4]} the file lacks, and the file "
             f"{sorted(have - want)[:4]} the model lacks")
    return model


def adapters(folder):
    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def compare_adapters(got, want, what):
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{what}: {len(want)} adapter tensors, max abs difference {worst:.3g}")
    if set(got) != set(want) or worst > PARAM_ATOL:
        fail(f"{what}: the adapters differ (max abs {worst:.3g}, keys equal: {set(got) == set(want)})")


def main():
    os.makedirs(WORK, exist_ok=True)
    hf_dir = os.path.join(WORK, "hf")
    save(base_model(), hf_dir)
    model_yaml = "{name: llama, from_hf: " + hf_dir + "}"
    one = with_lora(H.write_config("lora_one", model_yaml, STEPS, LR, VOCAB))
    run_one = H.run(one)
    got = H.composer_losses(run_one)

    init_folder = peft_export(one, os.path.join(WORK, "peft_init"), "--weights", os.path.join(run_one, "init.safetensors"))
    cfg = json.load(open(os.path.join(init_folder, "adapter_config.json")))
    print(f"adapter_config.json: r {cfg['r']}, lora_alpha {cfg['lora_alpha']}, target_modules {cfg['target_modules'][:60]}...")
    model = load_peft(hf_dir, init_folder, trainable=True)
    want = sgd_losses(model, run_one, STEPS, LR)  # the frozen base gets no gradient, so SGD leaves it
    data = Data(load_config(run_one), torch.float32)
    H.compare_losses(got, want, "one device vs transformers + peft from the same adapters")
    trained = {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}

    final_folder = peft_export(one, os.path.join(WORK, "peft_final"), "--weights", os.path.join(run_one, "final.safetensors"))
    compare_adapters(adapters(final_folder), trained, "exported final adapters vs peft's trained ones")
    loaded = load_peft(hf_dir, final_folder)
    with torch.no_grad():
        a, _ = batch_loss(loaded.eval(), data, STEPS)
        b, _ = batch_loss(model.eval(), data, STEPS)
    print(f"loss on step {STEPS}'s batch: the exported adapter in peft {a.item():.6f}, peft's trained model {b.item():.6f}")
    if abs(a.item() - b.item()) > LOSS_RTOL * abs(b.item()):
        fail(f"the exported adapter's loss {a.item()} differs from peft's trained model's {b.item()}")

    four = with_lora(H.write_config("lora_tp_fsdp", model_yaml, STEPS, LR, VOCAB, TP_FSDP, "checkpoint: {interval: 3}"))
    run_four = H.run(four)
    H.compare_losses(H.composer_losses(run_four), want, "tp 2 (sp) x fully_shard dp 2 vs transformers + peft")
    ckpt = os.path.join(run_four, "checkpoints", "step-000003")
    compare_adapters(adapters(peft_export(four, os.path.join(WORK, "peft_tp_fsdp"), "--checkpoint", ckpt)),
                     adapters(final_folder), "the 4-rank step-3 checkpoint's adapters vs the one-device run's")

    merged_dir = os.path.join(WORK, "merged")
    print(H.composer("export", "--config", four, "--checkpoint", ckpt, "--out", merged_dir, "--format", "hf",
                     "--merge").strip())
    merged = H.load_export(merged_dir).eval()
    reference = load_peft(hf_dir, final_folder).merge_and_unload()
    got_w, want_w = merged.state_dict(), reference.state_dict()
    worst = max((got_w[k] - want_w[k]).abs().max().item() for k in want_w)
    print(f"--merge: {len(got_w)} tensors vs peft's merge_and_unload, max abs difference {worst:.3g}")
    if set(got_w) != set(want_w) or worst > PARAM_ATOL:
        fail(f"the merged export differs from peft's merge_and_unload (max abs {worst:.3g})")
    with torch.no_grad():
        c, _ = batch_loss(merged, data, STEPS)
    print(f"loss on step {STEPS}'s batch: the merged export in transformers {c.item():.6f}")
    if abs(c.item() - b.item()) > LOSS_RTOL * abs(b.item()):
        fail(f"the merged export's loss {c.item()} differs from peft's trained model's {b.item()}")

    saved = os.path.join(WORK, "peft_saved")
    model.save_pretrained(saved)  # peft's own folder of its trained adapters
    cont_yaml = "{name: llama, from_hf: " + hf_dir + ", lora_from: " + saved + "}"
    cont = with_lora(H.write_config("lora_from", cont_yaml, 2, LR, VOCAB, TP_FSDP))
    run_cont = H.run(cont)
    want_cont = sgd_losses(load_peft(hf_dir, saved, trainable=True), run_cont, 2, LR)
    H.compare_losses(H.composer_losses(run_cont), want_cont,
                     "lora_from peft's folder, tp 2 (sp) x fully_shard dp 2, vs peft continuing from it")
    out = H.composer("plan", "--config", cont, "--set", "train.lora.rank=8", expect=2)
    if "model.lora_from" not in out or "train.lora.rank" not in out:
        fail(f"lora_from with another rank: {out}")
    other = os.path.join(WORK, "peft_other_base")
    torch.manual_seed(1)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    from peft import LoraConfig, get_peft_model  # noqa: E402
    get_peft_model(small, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"])
                   ).save_pretrained(other)
    out = H.composer("plan", "--config", cont, "--set", "model.lora_from=" + other, expect=2)
    if "model.lora_from" not in out or "another base" not in out:
        fail(f"lora_from an adapter of another base: {out}")
    print("refused: lora_from with another rank, and an adapter of another base")

    plain = H.write_config("plain", model_yaml, 1, LR, VOCAB)
    out = H.composer("export", "--config", plain, "--weights", os.path.join(run_one, "init.safetensors"), "--out",
                     os.path.join(WORK, "refused"), "--format", "peft", expect=2)
    if "has no train.lora" not in out:
        fail(f"--format peft without train.lora: {out}")
    out = H.composer("export", "--config", plain, "--weights", os.path.join(run_one, "init.safetensors"), "--out",
                     os.path.join(WORK, "refused"), "--format", "hf", "--merge", expect=2)
    if "has no train.lora" not in out:
        fail(f"--merge without train.lora: {out}")
    out = H.composer("export", "--config", one, "--weights", os.path.join(run_one, "final.safetensors"), "--out",
                     os.path.join(WORK, "refused.safetensors"), expect=2)
    if "--merge" not in out:
        fail(f"a LoRA run's pt export without --merge: {out}")
    print("hf_lora: all checks passed")


if __name__ == "__main__":
    main()

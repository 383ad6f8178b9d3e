"""What tests/cli/hf_llama.py, hf_mixtral.py and hf_qwen3.py share: composer run as a subprocess, its
losses, an exported Hugging Face folder loaded and compared, transformers' model trained by
torch.optim.SGD on composer's batches. Each test makes one Harness for its part. Importing it first
keeps transformers offline and quiet."""
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
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "reference"))
from reference import Data, load_config  # noqa: E402

# Plans the families' tests share (YAML mesh and parallelize sections, 4 ranks or 2).
CP_RING_TP = """mesh: {shape: [2, 2], names: [cp, tp]}
parallelize:
  - tensor_parallel: {mesh_dim: tp}
  - context_parallel: {mesh_dim: cp}"""
CP_ALLTOALL_AC = """mesh: {shape: [2], names: [cp]}
parallelize:
  - context_parallel: {mesh_dim: cp, rotate: alltoall}
  - activation_checkpointing: {units: [layers.*]}"""
EP_FSDP = """mesh: {shape: [2, 2], names: [dp, ep]}
parallelize:
  - expert_parallel: {mesh_dim: ep}
  - fully_shard: {mesh_dim: dp, units: ['layers.*']}"""


def batch_loss(model, data, step):
    """transformers' model on composer's batch of `step`: the cross-entropy loss and the logits."""
    x, y = data.batch(step, 0, data.global_batch)
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)), logits


def sgd_losses(model, run_dir, steps, lr, dtype=torch.float32):
    """transformers' model trained by torch.optim.SGD at `lr` on composer's batches: the losses."""
    data = Data(load_config(run_dir), dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(1, steps + 1):
        loss, _ = batch_loss(model, data, step)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def norms_away_from_one(model):
    """Every norm weight drawn from [0.5, 1.5], so that a swapped norm shows; returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def save(model, folder, shard=None):
    shutil.rmtree(folder, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)


class Harness:
    """One test part: its composer binary, work folder, the transformers class its exports load as, and the
    loss tolerance against transformers."""

    def __init__(self, name, composer, work, part, model_class, loss_rtol):
        self.name, self.composer_bin, self.work, self.part = name, composer, work, part
        self.model_class, self.loss_rtol = model_class, loss_rtol

    def write_config(self, name, model, steps, lr, vocab, mesh="", extra=""):
        """A training config of `model` (its YAML) on the shared token file: seq 16, batch 8, SGD."""
        path = os.path.join(self.work, name + ".yaml")
        with open(path, "w") as f:
            f.write(f"""name: {name}
seed: 3
model: {model}
{mesh}
train:
  steps: {steps}
  global_batch: 8
  optimizer: {{name: sgd, lr: {lr}}}
  loss: {{name: cross_entropy}}
data: {{source: tokens, path: {self.tokens_file(vocab)}, token_dtype: uint16, seq_len: 16}}
{extra}
""")
        return path

    def tokens_file(self, vocab):
        path = os.path.join(self.work, "tokens.bin")
        np.random.default_rng(0).integers(0, vocab, size=6000).astype("<u2").tofile(path)
        return path

    def fail(self, message):
        sys.exit(f"{self.name} {self.part}: {message}")

    def composer(self, *args, expect=0):
        r = subprocess.run([self.composer_bin, *args], capture_output=True, text=True)
        if r.returncode != expect:
            self.fail(f"composer {' '.join(args)} exited {r.returncode}, expected {expect}:\n{r.stdout[-3000:]}\n"
                      f"{r.stderr[-3000:]}")
        return r.stdout + r.stderr

    def run(self, config):
        out = os.path.join(self.work, os.path.basename(config)[:-5])
        shutil.rmtree(out, ignore_errors=True)
        self.composer("run", "--config", config, "--out", out)
        return out

    @staticmethod
    def composer_losses(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line)["loss"] for line in f if '"loss"' in line]

    def compare_losses(self, got, want, what):
        rtol = self.loss_rtol
        errs = [abs(g - w) / abs(w) for g, w in zip(got, want)]
        worst = max(errs)
        print(f"{what}: losses {['%.6f' % g for g in got]}, transformers {['%.6f' % w for w in want]}, "
              f"rel err {['%.2g' % e for e in errs]}")
        if len(got) != len(want) or worst > rtol:
            self.fail(f"{what}: composer's losses {got} differ from transformers' {want} (max rel err {worst:.3g})")

    def load_export(self, folder, model_class=None):
        """`folder` loaded by from_pretrained (the test's class, or `model_class`) with nothing missing,
        unexpected or mis-shaped."""
        model, info = (model_class or self.model_class).from_pretrained(folder, output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        if bad:
            self.fail(f"transformers loaded {folder} with {bad}")
        return model.float()

    def export(self, config, out, *source, shard=None):
        shutil.rmtree(out, ignore_errors=True)
        extra = ["--max-shard-size", shard] if shard else []
        print(self.composer("export", "--config", config, *source, "--out", out, "--format", "hf", *extra).strip())

    @staticmethod
    def folder_tensors(folder):
        index = os.path.join(folder, "model.safetensors.index.json")
        files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else [
            "model.safetensors"]
        out = {}
        for f in files:
            out.update(load_file(os.path.join(folder, f)))
        return out

    def roundtrip(self, hf_dir, config, tag, identical):
        """Hugging Face -> composer (the run's init.safetensors) -> Hugging Face; `identical(a, b)` compares
        the two folders and returns the tensor count."""
        run_dir = self.run(config)
        back = os.path.join(self.work, f"rt_back_{tag}")
        self.export(config, back, "--weights", os.path.join(run_dir, "init.safetensors"))
        n = identical(hf_dir, back)
        print(f"{tag}: Hugging Face -> composer -> Hugging Face: {n} tensors bit-identical, config.json equal")

    def bit_identical(self, a_dir, b_dir, config_class, keys, same=lambda key, want, got: False):
        """Every tensor of the two folders equal bit for bit, and their config.json's `keys` (or `same` says
        the two values mean the same); returns the tensor count."""
        a, b = self.folder_tensors(a_dir), self.folder_tensors(b_dir)
        if sorted(a) != sorted(b):
            self.fail(f"{b_dir} has tensors {sorted(set(a) ^ set(b))} that {a_dir} does not, or the reverse")
        for name in a:
            if a[name].dtype != b[name].dtype or a[name].shape != b[name].shape or not torch.equal(
                    a[name].view(torch.int32), b[name].view(torch.int32)):
                self.fail(f"{name}: {b_dir}'s differs from {a_dir}'s")
        want = config_class.from_pretrained(a_dir).to_dict()
        got = config_class.from_pretrained(b_dir).to_dict()
        for key in keys:
            if want.get(key) != got.get(key) and not same(key, want, got):
                self.fail(f"config.json {key}: {got.get(key)} in {b_dir}, {want.get(key)} in {a_dir}")
        return len(a)

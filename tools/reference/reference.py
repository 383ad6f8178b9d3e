#!/usr/bin/env python3
"""Independent reference for composer's single-device training.

Given a composer run directory (config.resolved.json and init.safetensors,
written by `composer run`), trains the same model in plain PyTorch with the
same initial weights, data, loss, optimizer, schedule and clipping, and writes
a golden file in composer's format. Run with the project environment's torch:

    .venv/bin/python tools/reference/reference.py --run-dir runs/x --golden tests/golden/x.json
"""
import argparse
import base64
import json
import math
import os
import re
import shutil
import struct
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import blend  # noqa: E402
import float8  # noqa: E402
import models  # noqa: E402

GOLDEN_FORMAT = 1
FULL_LIMIT = 1 << 20
SAMPLES = 512
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        buf = bytearray(data[begin:end])
        t = torch.frombuffer(buf, dtype=ST_DTYPES[e["dtype"]]) if buf else torch.empty(0, dtype=ST_DTYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out


def sample_seed(seed, step, index):
    h = blend.splitmix64(seed)
    h = blend.splitmix64(h ^ step)
    h = blend.splitmix64(h ^ index)
    return h & 0x7FFFFFFFFFFFFFFF


class Data:
    """Samples as a pure function of (seed, step, index), as composer draws them."""

    def __init__(self, cfg, dtype):
        d = cfg["data"]
        self.seed = cfg["seed"]
        self.inputs, self.targets, self.seq_len = d["inputs"], d["targets"], d["seq_len"]
        self.out_shape = d["output_shape"]
        self.vocab, self.features = d["vocab_size"], d["features"]
        self.dtype = dtype
        self.global_batch = cfg["train"]["global_batch"]
        self.file = None
        self.tokens = None
        self.documents = d.get("documents")  # packed documents: {mask, eos_id, loss_on_boundary}
        if d["source"] == "file":
            self.file = read_safetensors(d["path"])
        elif d["source"] == "tokens":
            sources = d.get("sources") or [{"path": d["path"], "weight": 1.0}]
            width = 2 if d["token_dtype"] == "uint16" else 4
            kind = {"uint16": torch.uint16, "uint32": torch.uint32}[d["token_dtype"]]
            self.sources = [torch.from_file(s["path"], dtype=kind, size=os.path.getsize(s["path"]) // width)
                            for s in sources]
            self.weights = [s["weight"] for s in sources]
            self.ends = None
            if self.documents and self.documents["eos_id"] < 0:
                self.ends = [[int(e) for e in torch.from_file(s["path"] + ".docs", dtype=torch.int64,
                                                              size=os.path.getsize(s["path"] + ".docs") // 8)]
                             for s in sources]
            # data.loss_mask: each file's <path>.mask, one byte per token, 1 where it is trained as a target
            self.masks = [torch.from_file(s["path"] + ".mask", dtype=torch.uint8, size=os.path.getsize(s["path"] + ".mask"))
                          for s in sources] if d.get("loss_mask") else None
            self.tokens = self.sources[0]

    def sample(self, step, index):
        g = torch.Generator()
        g.manual_seed(sample_seed(self.seed, step, index))
        if self.targets == "next_tokens":
            seq = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
            return seq[:-1], seq[1:]
        if self.inputs == "tokens":
            x = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        elif self.inputs == "uniform":
            x = torch.rand(self.features, generator=g).to(self.dtype)
        else:
            x = torch.randn(self.features, generator=g).to(self.dtype)
        y = None
        if self.targets == "normal":
            y = torch.randn(self.out_shape, generator=g)
        elif self.targets == "uniform":
            y = torch.rand(self.out_shape, generator=g)
        elif self.targets == "tokens":
            y = torch.randint(0, self.out_shape[-1], tuple(self.out_shape[:-1]), generator=g)
        return x, y

    def windows(self, step, begin, end):
        """Samples begin..end-1 of `step`: their token windows (seq_len + 1 ids) and, with packed
        documents, each window's doc_start row (tools/reference/blend.py)."""
        return self.windows_and_masks(step, begin, end)[:2]

    def windows_and_masks(self, step, begin, end):
        """windows(), and with data.loss_mask each window's mask bytes (else None)."""
        span = self.seq_len + 1
        rows, starts, masks = [], [], []
        for i in range(begin, end):
            g = (step - 1) * self.global_batch + i
            src = blend.blend_source(self.seed, g, self.weights) if len(self.sources) > 1 else 0
            tokens = self.sources[src]
            at = blend.token_window(self.seed, g, len(tokens) - span + 1)
            w = tokens[at:at + span].to(torch.int64)
            rows.append(w)
            if self.masks is not None:
                masks.append(self.masks[src][at:at + span].to(torch.bool))
            if self.documents:
                starts.append(blend.doc_start_index(self.ends[src], at, span) if self.ends is not None
                              else blend.doc_start_eos(w.tolist(), self.documents["eos_id"]))
        return (torch.stack(rows), (torch.tensor(starts, dtype=torch.int64) if self.documents else None),
                torch.stack(masks) if masks else None)

    def doc_start(self, step, begin, end):
        """The inputs' doc_start rows (packed documents), else None."""
        if self.tokens is None or not self.documents:
            return None
        return self.windows(step, begin, end)[1][:, :-1]

    def drops_targets(self):
        """Whether the loss drops targets: packed documents without loss_on_boundary, or data.loss_mask."""
        return self.tokens is not None and ((self.documents and not self.documents["loss_on_boundary"])
                                            or self.masks is not None)

    def loss_tokens(self, step):
        """When the loss drops targets: the count of `step`'s global batch's targets kept (the loss's
        divisor, at least 1), else None."""
        if not self.drops_targets():
            return None
        y = self.batch(step, 0, self.global_batch)[1]
        return max(float((y != -100).sum()), 1.0)

    def batch(self, step, begin, end):
        if self.tokens is not None:
            w, starts, masks = self.windows_and_masks(step, begin, end)
            y = w[:, 1:] if self.targets == "next_tokens" else None
            if y is not None and starts is not None and not self.documents["loss_on_boundary"]:
                y = y.masked_fill(starts[:, 1:] == torch.arange(1, w.size(1)), -100)
            if y is not None and masks is not None:  # target k is token k + 1
                y = y.masked_fill(~masks[:, 1:], -100)
            return w[:, :-1], y
        if self.file is not None:
            n = self.file["inputs"].shape[0]
            idx = (torch.arange(begin, end) + (step - 1) * self.global_batch) % n
            x = self.file["inputs"][idx]
            if self.inputs != "tokens":
                x = x.to(self.dtype)
            y = None
            if self.targets != "none":
                y = self.file["targets"][idx]
                if self.targets not in ("tokens", "next_tokens"):
                    y = y.float()
            return x, y
        xs, ys = zip(*(self.sample(step, i) for i in range(begin, end)))
        return torch.stack(xs), (None if ys[0] is None else torch.stack(ys))


def loss_fn(cfg, out, target, n, global_batch, tokens=None):
    """The microbatch's share of the global-batch loss; with `tokens` (packed documents without
    loss_on_boundary) cross entropy summed over the targets that are not -100, divided by `tokens`, the
    global batch's count of them."""
    name, scale = cfg["name"], cfg["scale"]
    y = out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
    if tokens is not None and name == "cross_entropy":
        return F.cross_entropy(y.reshape(-1, y.size(-1)), target.reshape(-1), reduction="sum") / tokens * scale
    if name == "sum":
        return y.sum() * scale
    if name == "mean":
        l = y.mean()
    elif name == "mse":
        l = F.mse_loss(y, target.to(y.dtype))
    elif name == "cross_entropy":
        l = F.cross_entropy(y.reshape(-1, y.size(-1)), target.reshape(-1))
    elif name == "soft_cross_entropy":
        l = F.cross_entropy(y.reshape(-1, y.size(-1)), target.to(y.dtype).reshape(-1, y.size(-1)))
    else:
        raise ValueError(name)
    return l * (n / global_batch * scale)


def eval_loss_fn(cfg, model, dtype, mixed, B, M):
    """composer's eval (cfg["eval"]): the mean loss of eval.batches global batches of the held-out data
    (eval.data's source, path and token_dtype over the training data plan; samples drawn under the seed
    xor "eval-see"), in eval mode and without gradients; None without eval."""
    ev = cfg.get("eval", {})
    if not ev.get("every"):
        return None
    if mixed:
        sys.exit("reference: eval with --param-dtype or --all-gather is not supported; drop eval from the config")
    ecfg = dict(cfg)
    ecfg["data"] = dict(cfg["data"])
    ecfg["data"].update({k: v for k, v in ev.get("data", {}).items()
                         if k in ("source", "path", "token_dtype", "sources")})
    if ev.get("data", {}).get("path"):  # one held-out file: the training blend does not apply
        ecfg["data"].pop("sources", None)
    # eval.global_batch and eval.seq_len: eval's own geometry (a sample's index counts in eval batches)
    B = ev.get("global_batch", B)
    ecfg["train"] = dict(cfg["train"], global_batch=B)
    if ev.get("seq_len"):
        ecfg["data"]["seq_len"] = ev["seq_len"]
    ecfg["seed"] = cfg["seed"] ^ 0x6576616C2D736565
    data, mb = Data(ecfg, dtype), B // M

    def evaluate():
        model.eval()
        total = 0.0
        with torch.no_grad():
            for j in range(1, ev["batches"] + 1):
                tokens = data.loss_tokens(j)
                for m in range(M):
                    x, y = data.batch(j, m * mb, (m + 1) * mb)
                    models.set_documents(model, data.doc_start(j, m * mb, (m + 1) * mb))
                    total += loss_fn(cfg["train"]["loss"], model(x), y, mb, B, tokens).item()
        model.train()
        return total / ev["batches"]
    return evaluate


def fqn_pattern(pattern):
    """composer's FQN pattern as a regular expression: '*' within a dotted segment, '**' across."""
    return re.compile("".join(".*" if part == "**" else "[^.]*" if part == "*" else re.escape(part)
                              for part in re.split(r"(\*\*|\*)", pattern)) + r"\Z")


def trainable(model, freeze, lora=False):
    """train.freeze: the parameters a pattern names, or whose module (or a module above it) it names,
    stop requiring gradients, and with train.lora every parameter but the adapters; the rest, each
    once, in the model's order."""
    patterns = [fqn_pattern(f) for f in freeze]
    for name, p in model.named_parameters():
        prefixes = [".".join(name.split(".")[:k]) for k in range(len(name.split(".")), 0, -1)]
        if any(r.match(x) for r in patterns for x in prefixes) or (lora and name.split(".")[-1] not in ("lora_A", "lora_B")):
            p.requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]


def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's _zeropower_via_newtonschulz with the iterations in float32 instead of
    bfloat16 (optimizer.muon.ns_dtype: float32): the same calls, line for line."""
    a, b, c = ns_coefficients
    ortho_grad = grad.float().clone()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad


class MuonWithAdamW:
    """optimizer name muon: torch.optim.Muon for every 2-D parameter optimizer.muon.exclude leaves,
    each expert of a 3-D [experts, out, in] stack as a 2-D parameter of its own (torch.optim.Muon takes
    matrices only), and torch.optim.AdamW with optimizer's lr, betas, eps and weight_decay for the
    rest. The AdamW group comes first: its lr is the one a golden records."""

    def __init__(self, o, named):
        m = o["muon"]
        excluded = [fqn_pattern(x) for x in m["exclude"]]
        self.stacks, matrices, rest = [], [], []
        for name, p in named:
            if p.ndim not in (2, 3) or any(r.match(name) for r in excluded):
                rest.append(p)
            elif p.ndim == 2:
                matrices.append(p)
            else:
                experts = [torch.nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])]
                self.stacks.append((p, experts))
                matrices += experts
        self.optimizers = []
        if rest:
            self.optimizers.append(torch.optim.AdamW(rest, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                                     weight_decay=o["weight_decay"], foreach=False))
        if m["ns_dtype"] == "float32":
            import torch.optim._muon as muon_module
            muon_module._zeropower_via_newtonschulz = newton_schulz_float32
        elif m["ns_dtype"] != "bfloat16":
            sys.exit(f"reference: optimizer.muon.ns_dtype {m['ns_dtype']}: bfloat16 or float32")
        if matrices:
            self.optimizers.append(torch.optim.Muon(
                matrices, lr=m["lr"] or o["lr"], weight_decay=o["weight_decay"], momentum=m["momentum"],
                nesterov=m["nesterov"], ns_coefficients=tuple(m["ns_coefficients"]), eps=m["eps"],
                ns_steps=m["ns_steps"], adjust_lr_fn=m["adjust_lr_fn"]))
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        for p, _ in self.stacks:  # the stacks themselves are in no optimizer
            p.grad = None

    def step(self):
        for p, experts in self.stacks:
            for e, q in enumerate(experts):
                q.grad = None if p.grad is None else p.grad[e].clone()
        for opt in self.optimizers:
            opt.step()
        with torch.no_grad():
            for p, experts in self.stacks:
                for e, q in enumerate(experts):
                    p[e].copy_(q)


class Schedulers:
    """One schedule over several optimizers (MuonWithAdamW's), stepped together."""

    def __init__(self, schedulers):
        self.schedulers = schedulers

    def step(self):
        for s in self.schedulers:
            s.step()


def make_optimizer(o, params, names=None):
    if o["name"] == "muon":
        return MuonWithAdamW(o, zip(names, params))
    if o["name"] == "sgd":
        return torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"], dampening=o["dampening"],
                               nesterov=o["nesterov"], weight_decay=o["weight_decay"], foreach=False)
    cls = torch.optim.Adam if o["name"] == "adam" else torch.optim.AdamW
    return cls(params, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"],
               foreach=False)


def make_scheduler(opt, o, s, steps):
    """composer's lr_schedule as PyTorch's own schedulers, stepped once after each optimizer step:
    LinearLR warms up from lr / warmup_steps (step 1) to lr (step warmup_steps); then a constant lr,
    LinearLR to min_lr or CosineAnnealingLR to min_lr over the remaining steps; SequentialLR chains
    them."""
    if isinstance(opt, MuonWithAdamW):
        return Schedulers([make_scheduler(x, o, s, steps) for x in opt.optimizers])
    sched = torch.optim.lr_scheduler
    lr, w = o["lr"], s["warmup_steps"]
    rest = max(1, steps - w)
    if s["decay"] == "none":
        decay = sched.LambdaLR(opt, lambda i: 1.0)
    elif s["decay"] == "linear":
        decay = sched.LinearLR(opt, start_factor=1.0, end_factor=s["min_lr"] / lr, total_iters=rest)
    else:
        decay = sched.CosineAnnealingLR(opt, T_max=rest, eta_min=s["min_lr"])
    if w == 0:
        return decay
    warmup = sched.LinearLR(opt, start_factor=1.0 / w, end_factor=1.0, total_iters=w - 1)
    return sched.SequentialLR(opt, [warmup, decay], milestones=[w])


class MixedPrecision:
    """fully_shard's mixed-precision policy on one device: the parameters (float32 masters) compute
    through copies cast to param_dtype each step, float inputs enter the model in param_dtype and its
    output leaves in the training dtype, and each microbatch's gradients are cast to reduce_dtype and
    summed there (composer's reduce-scatter input and its accumulation over microbatches), then
    handed to the optimizer in the masters' dtype. With gather_dtype (the bfloat16 all-gather
    extension) the copies are the masters rounded to gather_dtype and cast back to param_dtype."""

    def __init__(self, model, param_dtype, reduce_dtype, gather_dtype=None):
        self.model, self.param_dtype, self.reduce_dtype = model, param_dtype, reduce_dtype
        self.gather_dtype = gather_dtype or param_dtype
        self.masters = list(model.parameters())
        self.train_dtype = self.masters[0].dtype
        index = {id(p): i for i, p in enumerate(self.masters)}
        # Every (module, attribute) holding a parameter, with the parameter's index: a tied weight
        # has several, all of which compute with the one copy.
        self.slots = [(mod, name, index[id(p)]) for mod in model.modules()
                      for name, p in mod._parameters.items() if p is not None]
        self.copies = []

    def cast_parameters(self):
        self.copies = [p.detach().to(self.gather_dtype).to(self.param_dtype).requires_grad_() for p in self.masters]
        self.acc = [None] * len(self.masters)
        for mod, name, i in self.slots:
            mod._parameters[name] = self.copies[i]

    def restore_masters(self):
        for mod, name, i in self.slots:
            mod._parameters[name] = self.masters[i]

    def forward(self, x):
        if x.is_floating_point():
            x = x.to(self.param_dtype)
        y = self.model(x)
        return y.to(self.train_dtype) if y.is_floating_point() else y

    def accumulate_gradients(self):
        for i, c in enumerate(self.copies):
            if c.grad is None:
                continue
            g = c.grad.to(self.reduce_dtype)
            self.acc[i] = g if self.acc[i] is None else self.acc[i] + g
            c.grad = None
        for p, g in zip(self.masters, self.acc):
            p.grad = None if g is None else g.to(p.dtype)


def degenerate(records):
    """Why these steps make a golden that cannot tell right from wrong (a zero or constant loss or
    gradient norm), or None. The same rule as composer's golden writer."""
    for key in ("loss", "grad_norm"):
        zero = [r["step"] for r in records if r[key] == 0]
        if zero:
            return "%s is 0 at step(s) %s" % (key, ", ".join(map(str, zero)))
        if len(records) > 1 and len({r[key] for r in records}) == 1:
            return "%s is the same at every step" % key
    return None


def golden_param(name, t):
    flat = t.detach().double().flatten()
    n = flat.numel()
    sampled = n > FULL_LIMIT
    values = flat[torch.arange(SAMPLES) * n // SAMPLES] if sampled else flat
    raw = values.contiguous().numpy().astype("<f8").tobytes()
    return {"name": name, "shape": list(t.shape), "l2": flat.norm().item(), "sampled": sampled,
            "float64_base64": base64.b64encode(raw).decode()}


def load_config(run_dir):
    """The resolved config composer wrote into a run directory."""
    with open(os.path.join(run_dir, "config.resolved.json")) as f:
        return json.load(f)


def add_lora(model, lora):
    """train.lora as PEFT computes it: every nn.Linear inside a module a target pattern names gets
    lora_A [rank, in] and lora_B [out, rank] (their values come from the run's initial weights), and
    its output gains lora_B(lora_A(dropout(x))) * alpha / rank."""
    if not lora:
        return
    patterns = [fqn_pattern(t) for t in lora["targets"]]
    chosen = {}
    for name, m in model.named_modules():
        if name and any(r.match(name) for r in patterns):
            for sub, inner in m.named_modules():
                if isinstance(inner, torch.nn.Linear):
                    chosen[id(inner)] = inner
    scaling, p = lora["alpha"] / lora["rank"], lora["dropout"]
    for m in chosen.values():
        m.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(lora["rank"], m.in_features)))
        m.register_parameter("lora_B", torch.nn.Parameter(torch.zeros(m.out_features, lora["rank"])))
        m.register_forward_hook(lambda m, args, out: out + F.linear(
            F.linear(F.dropout(args[0], p, m.training), m.lora_A), m.lora_B) * scaling)


def build_model(cfg, run_dir, who="reference"):
    """cfg's model with the run's initial weights, in the training dtype, in training mode."""
    model = models.build(cfg["model"]["name"], cfg["model"]["args"])
    add_lora(model, cfg["train"].get("lora"))
    init = read_safetensors(os.path.join(run_dir, "init.safetensors"))
    named = dict(model.named_parameters())  # each tensor once, as composer saves them
    # composer's weights files carry the floating-point buffers too (a router's expert bias, BatchNorm's
    # running statistics): those the file holds are read as well.
    buffers = {n: b for n, b in model.named_buffers() if b.is_floating_point() and n in init}
    missing = [n for n in named if n not in init]
    unexpected = [n for n in init if n not in named and n not in buffers]
    if missing or unexpected:
        sys.exit(f"{who}: weights do not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for n, p in list(named.items()) + list(buffers.items()):
            if tuple(p.shape) != tuple(init[n].shape):
                sys.exit(f"{who}: {n} has shape {tuple(init[n].shape)}, the model {tuple(p.shape)}")
            p.copy_(init[n])
    # Cast parameters only: Module.to(dtype) would also turn Llama's complex
    # freqs_cis buffer real.
    dtype = DTYPES[cfg["train"]["dtype"]]
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.train()
    return model


def golden_init_path(golden):
    """Where the initial weights a golden was trained from go: x.json gives x.init.safetensors."""
    return (golden[:-len(".json")] if golden.endswith(".json") else golden) + ".init.safetensors"


def write_golden(path, cfg, records, named_params, generator, command, policy, who="reference", init=None):
    """Writes records (step, loss, grad_norm, lr) and the final parameters (name, tensor) as a golden
    file in composer's format, with the rounding policy a plan must use to be checked against it
    (composer's comparator reads it); refuses a degenerate one. `init`, the run's init.safetensors,
    goes beside it when the config draws its initial weights (no init_from or from_hf): composer
    check trains from it, so the golden holds where another CPU's random fills round otherwise."""
    dead = degenerate(records)
    if dead:
        sys.exit("%s: refusing to write %s: %s; change the seed, learning rate or loss so every step "
                 "trains" % (who, path, dead))
    golden = {
        "format_version": GOLDEN_FORMAT,
        "generator": generator,
        "name": cfg["name"],
        "command": command,
        "config_hash": cfg["config_hash"],
        "libtorch_version": torch.__version__.split("a")[0].split("+")[0],
        "dtype": cfg["train"]["dtype"],
        **policy,
        "steps": records,
        "params": [golden_param(n, p) for n, p in named_params],
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    print(f"wrote {path}")
    if init and not cfg["model"].get("init_from") and not cfg["model"].get("from_hf"):
        shutil.copyfile(init, golden_init_path(path))
        print(f"wrote {golden_init_path(path)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="composer output directory of a single-device run")
    ap.add_argument("--golden", required=True, help="golden file to write")
    ap.add_argument("--param-dtype", choices=["bfloat16", "float16"], default=None,
                    help="train under fully_shard's mixed-precision policy: every parameter computes in a copy cast "
                         "to this dtype, float inputs are cast to it at the model's entry and the output back, and "
                         "gradients are accumulated and applied in --reduce-dtype")
    ap.add_argument("--reduce-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="with --param-dtype: the dtype gradients are cast to and accumulated in (fully_shard's "
                         "reduce_dtype) before the optimizer sees them in the training dtype")
    ap.add_argument("--all-gather", choices=["bfloat16"], default=None,
                    help="train as fully_shard's bfloat16 all-gather extension does: every parameter computes in "
                         "the training dtype with its value rounded to this dtype; gradients stay in the training "
                         "dtype")
    args = ap.parse_args()
    if args.param_dtype and args.all_gather:
        ap.error("--param-dtype and --all-gather are two policies; give one")

    cfg = load_config(args.run_dir)
    t = cfg["train"]
    dtype = DTYPES[t["dtype"]]
    torch.set_num_threads(max(1, t["threads"] or os.cpu_count()))

    model = build_model(cfg, args.run_dir)
    if "fp8" in t:
        print(f"reference: {float8.convert(model, t['fp8']['modules'])} Linear layers in float8")

    data = Data(cfg, dtype)

    params = trainable(model, t.get("freeze", []), lora=bool(t.get("lora")))
    opt = make_optimizer(t["optimizer"], params, [n for n, p in model.named_parameters() if p.requires_grad])
    scheduler = make_scheduler(opt, t["optimizer"], t["lr_schedule"], t["steps"])
    mixed = None
    if args.param_dtype:
        mixed = MixedPrecision(model, DTYPES[args.param_dtype], DTYPES[args.reduce_dtype])
    elif args.all_gather:
        mixed = MixedPrecision(model, dtype, dtype, gather_dtype=DTYPES[args.all_gather])
    steps, B, M = t["steps"], t["global_batch"], t["microbatches"]
    mb = B // M
    records = []
    evaluate = eval_loss_fn(cfg, model, dtype, mixed, B, M)
    for step in range(1, steps + 1):
        lr = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        total = 0.0
        if mixed:
            mixed.cast_parameters()
        tokens = data.loss_tokens(step)  # the step's divisor without loss_on_boundary (else None)
        for m in range(M):
            x, y = data.batch(step, m * mb, (m + 1) * mb)
            models.set_documents(model, data.doc_start(step, m * mb, (m + 1) * mb))
            out = mixed.forward(x) if mixed else model(x)
            loss = loss_fn(t["loss"], out, y, mb, B, tokens)
            # Mixture-of-experts load-balancing losses (per sequence, summed) weigh as samples of the loss
            # do; they join backward only, as composer's do (the logged loss is the model's).
            aux = sum(m.take_aux() for m in model.modules() if isinstance(m, models.LlamaMoE))
            (loss + aux * (t["loss"]["scale"] / B) if torch.is_tensor(aux) else loss).backward()
            total += loss.item()
            if mixed:
                mixed.accumulate_gradients()
        grads = [p.grad for p in params if p.grad is not None]
        max_norm = t["grad_clip"] if t["grad_clip"] > 0 else math.inf
        if all(g.dtype in (torch.float32, torch.float64) for g in grads):
            # PyTorch's own: the 2-norm of the gradients' 2-norms, and clipping by max_norm / (norm + 1e-6).
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item() if grads else 0.0
        else:
            # 16-bit gradients: clip_grad_norm_'s formula with each norm taken in float32, as composer
            # does (PyTorch would sum 16-bit squares in 16 bits).
            norms = [g.detach().float().norm(2) for g in grads]
            norm = torch.stack(norms).norm(2).item() if grads else 0.0
            coef = min(1.0, max_norm / (norm + 1e-6))
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        opt.step()
        scheduler.step()
        for m in model.modules():
            if isinstance(m, models.LlamaMoE):
                m.update_bias()
        if mixed:
            mixed.restore_masters()
        records.append({"step": step, "loss": total, "grad_norm": norm, "lr": lr})
        if evaluate and (step % cfg["eval"]["every"] == 0 or step == steps):
            records[-1]["eval_loss"] = evaluate()
        print(f"reference step {step}/{steps} loss {total:.6g} grad_norm {norm:.4g}")

    # The policy a plan must use to be checked against this golden (composer's comparator reads it).
    policy = {"param_dtype": args.param_dtype, "reduce_dtype": args.reduce_dtype} if args.param_dtype else {}
    if args.all_gather:
        policy = {"all_gather": args.all_gather}
    command = " ".join(["tools/reference/reference.py --run-dir", args.run_dir] +
                       ["--%s %s" % (k.replace("_", "-"), v) for k, v in policy.items()])
    write_golden(args.golden, cfg, records, model.named_parameters(), "pytorch-reference", command, policy,
                 init=os.path.join(args.run_dir, "init.safetensors"))


if __name__ == "__main__":
    main()

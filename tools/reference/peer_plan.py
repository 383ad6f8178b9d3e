"""How PyTorch's parallelisms see composer's models, for tools/reference/peer.py: the tensor
parallel plans (as PyTorch's tests and torchtitan write them), the pipeline's stage split,
fully_shard's units by pattern and expert parallelism's token dispatch (torchtitan's, in plain
PyTorch)."""
import fnmatch
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single as all_to_all_single_autograd
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel


class Unsupported(Exception):
    """A plan PyTorch's parallelisms cannot run here; the message says why."""


# ---- tensor parallel plans ---------------------------------------------------
# The models' plans as PyTorch's tests (docs/scenarios.md) and torchtitan write them.

def tp_plan(cfg, sp):
    name = cfg["model"]["name"]
    if sp and name not in ("transformer", "llama"):
        raise Unsupported(f"model {name} has no sequence-parallel plan")
    # A colwise output stays a DTensor (use_local_output=False) where the next rowwise layer takes it,
    # as M6's plan does, so that uneven shards keep their global shape.
    col, row = ColwiseParallel(use_local_output=False), RowwiseParallel()
    if name in ("mlp_module", "mlp"):
        a, b = ("net1", "net2") if name == "mlp_module" else ("in_proj", "out_proj")
        return {a: col, b: row}
    if name == "mlp_module_layers":
        return {"layers.*.net1": col, "layers.*.net2": row}
    if name == "mlp_module_even":
        return {"net1": col, "net2": row, "net3": ColwiseParallel(output_layouts=Replicate())}
    if name == "mlp_stack":  # M6: MLPStack.parallelize
        n = 3
        plan = {}
        for i in range(n):
            plan[f"{i}.in_proj"] = col
            plan[f"{i}.out_proj"] = RowwiseParallel(use_local_output=i == n - 1)
        return plan
    if name == "simple_model":
        return {"net1": col, "net2": row, "net3": ColwiseParallel(output_layouts=Replicate())}
    if name == "simple_model_uneven":
        return {"net1": col, "net2": row, "net3": col, "net4": row}
    if name == "transformer":  # M4: Transformer.parallelize (common_dtensor), local attention outputs
        lay = "layers.*."
        if sp:
            plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
                    "norm": SequenceParallel(),
                    lay + "attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                    lay + "attention_norm": SequenceParallel(), lay + "ffn_norm": SequenceParallel(),
                    lay + "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                    lay + "feed_forward.w1": ColwiseParallel(input_layouts=Shard(1)),
                    lay + "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        else:
            plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                    "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                    lay + "attention.wo": RowwiseParallel(),
                    lay + "feed_forward.w1": ColwiseParallel(),
                    lay + "feed_forward.w2": RowwiseParallel(),
                    "output": ColwiseParallel(output_layouts=Replicate())}
        for w in ("wq", "wk", "wv"):
            plan[lay + "attention." + w] = ColwiseParallel()
        return plan
    if name == "llama":  # torchtitan's apply_tp
        lay = "layers.*."
        seq = Shard(1) if sp else Replicate()
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
                "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
                lay + "attention.wo": RowwiseParallel(output_layouts=seq),
                lay + "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({"norm": SequenceParallel(),
                         lay + "attention_norm": SequenceParallel(), lay + "ffn_norm": SequenceParallel(),
                         lay + "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                               desired_input_layouts=(Replicate(), None)),
                         lay + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                                  desired_input_layouts=(Replicate(),))})
        for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[lay + w] = ColwiseParallel()
        return plan
    raise Unsupported(f"model {name} has no tensor-parallel plan here")


def layout(text):
    if text == "replicate":
        return Replicate()
    m = re.fullmatch(r"shard\((-?\d+)\)", text)
    if not m:
        raise Unsupported(f"layout {text}")
    return Shard(int(m.group(1)))


def custom_tp_plan(styles):
    """A `plan: custom` list of styles as PyTorch's ParallelStyles (the config's layouts, else PyTorch's
    defaults)."""
    plan = {}
    for s in styles:
        kw = {}
        if s.get("input"):
            kw["input_layouts"] = layout(s["input"])
        if s.get("output"):
            kw["output_layouts"] = layout(s["output"])
        style = s["style"]
        if style == "colwise":
            plan[s["module"]] = ColwiseParallel(use_local_output="output_layouts" in kw, **kw)
        elif style == "rowwise":
            plan[s["module"]] = RowwiseParallel(**kw)
        elif style == "sequence_parallel":
            plan[s["module"]] = SequenceParallel()
        else:
            plan[s["module"]] = PrepareModuleInput(input_layouts=kw.get("input_layouts"),
                                                   desired_input_layouts=layout(s["desired_input"]))
    return plan


def local_heads(model, tp):
    """Attention computes on the local heads: each tp rank's wq/wk/wv outputs hold 1/tp of them."""
    for m in model.modules():
        if hasattr(m, "n_heads") and hasattr(m, "wq"):
            m.n_heads //= tp
            if hasattr(m, "n_kv_heads"):
                m.n_kv_heads //= tp


# ---- pipeline stages -----------------------------------------------------------

def pieces(cfg, model):
    """The model's pipeline pieces in order, each (name, [module FQNs]); layers are the pieces that
    layers_per_stage and an even split count."""
    name = cfg["model"]["name"]
    if name == "mlp_module_layers":
        return [(f"layers.{i}", [f"layers.{i}"]) for i in range(len(model.layers))], "layers"
    if name in ("mlp_stack", "mlp_seq"):
        return [(n, [n]) for n, _ in model.named_children()], "sequential"
    if name == "transformer":
        return ([("embeddings", ["tok_embeddings", "pos_embeddings", "dropout"])] +
                [(f"layers.{i}", [f"layers.{i}"]) for i in range(len(model.layers))] +
                [("norm", ["norm", "output"])], "transformer")
    if name == "llama":
        return ([("tok_embeddings", ["tok_embeddings"])] +
                [(f"layers.{i}", [f"layers.{i}"]) for i in model.layers] + [("norm", ["norm", "output"])], "llama")
    raise Unsupported(f"model {name} has no pipeline pieces")


def split_stages(cfg, model, p):
    """The module FQNs of each of the pp x virtual_stages stages, by composer's split rules."""
    plist, kind = pieces(cfg, model)
    names = [n for n, _ in plist]
    layer_idx = [i for i, n in enumerate(names) if n.startswith("layers.") or kind == "sequential"]
    if p["split_points"]:
        starts = [names.index(s) for s in p["split_points"]]
    else:
        n_stages = p["pp"] * p["virtual_stages"]
        per = p["layers_per_stage"] or len(layer_idx) // n_stages
        starts = [layer_idx[per * s] for s in range(1, n_stages)]
    bounds = [0] + starts + [len(plist)]
    return [sum((plist[i][1] for i in range(a, b)), []) for a, b in zip(bounds, bounds[1:])], kind


class Stage(nn.Module):
    """One pipeline stage: the modules it holds under their full model's FQNs, and the forward of
    that part of the model (models.py's forwards, piece by piece)."""

    def __init__(self, model, fqns, kind, seq_len):
        super().__init__()
        self.kind, self.seq_len = kind, seq_len  # the whole sequence, whatever sequence parallelism holds
        self.order = []
        for fqn in fqns:
            mod = model.get_submodule(fqn)
            if "." in fqn:
                parent, child = fqn.split(".")
                if not hasattr(self, parent):
                    self.add_module(parent, nn.ModuleDict())
                getattr(self, parent)[child] = mod
            else:
                self.add_module(fqn, mod)
            self.order.append(fqn)
        if kind == "llama":
            self.register_buffer("freqs_cis", model.freqs_cis, persistent=False)

    def forward(self, h):
        for fqn in self.order:
            if fqn == "tok_embeddings":
                h = self.tok_embeddings(h)
                if self.kind == "transformer":
                    h = h + self.pos_embeddings(torch.arange(0, self.seq_len))
            elif fqn in ("pos_embeddings", "output"):
                continue
            elif fqn == "dropout":
                h = self.dropout(h)
            elif fqn == "norm":
                h = self.output(self.norm(h)).float()
            elif self.kind == "llama":
                h = self.get_submodule(fqn)(h, self.freqs_cis[0:self.seq_len])
            else:
                h = self.get_submodule(fqn)(h)
        # The zero-bubble schedules detach a stage's output in place (pipelining/_backward.py,
        # stage_backward_input), which fails on a view ("Can't detach views in-place") such as a
        # tensor-parallel layer's local output (DTensor.to_local); a copy is the same values.
        return h.clone() if h._base is not None else h


# ---- fully_shard units -----------------------------------------------------------

def matches(pattern, fqn):
    """composer's FQN patterns: '*' matches within one dotted segment."""
    a, b = pattern.split("."), fqn.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(y, x) for x, y in zip(a, b))


def units(module, patterns):
    """The modules each pattern names (a container without a forward of its own stands for its
    children), deepest first, as fully_shard must be applied."""
    found = {}
    for fqn, m in module.named_modules():
        if fqn and any(matches(p, fqn) for p in patterns):
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                for c, cm in m.named_children():
                    found[fqn + "." + c] = cm
            else:
                found[fqn] = m
    return sorted(found.items(), key=lambda kv: -kv[0].count("."))


# ---- expert parallel -------------------------------------------------------------

class ExpertParallelMoE(nn.Module):
    """A mixture-of-experts block (models.py's LlamaMoE) under expert_parallel over `group`, as
    torchtitan's ExpertParallel dispatches (torchtitan/distributed/expert_parallel.py), in plain
    PyTorch: this rank holds experts rank x N/ep ... (rank + 1) x N/ep - 1 and routes its own
    tokens; the per-expert counts go to every rank with dist.all_to_all_single; each (token,
    choice) row goes to its expert's rank and comes back by
    torch.distributed.nn.functional.all_to_all_single, whose backward is the all-to-all with the
    splits swapped; the received rows are reordered expert-major (torchtitan's permute) and each
    local expert runs on its own rows (its for-loop experts). The parameters keep LlamaMoE's names."""

    def __init__(self, moe, group):
        super().__init__()
        self.ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.n % self.ep:
            raise Unsupported(f"{moe.n} experts do not split over {self.ep} ranks")
        self.group, self.e = group, moe.n // self.ep
        self.moe = [moe]  # its routing (not registered: its parameters are this module's)
        self.router, self.experts, self.shared = moe.router, moe.experts, moe.shared
        for name in ("w1", "w2", "w3"):
            w = getattr(self.experts, name)
            setattr(self.experts, name, nn.Parameter(w.detach()[rank * self.e:(rank + 1) * self.e].clone()))

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        ids, weights = self.moe[0].route(flat)
        choice = ids.reshape(-1)
        order = torch.argsort(choice, stable=True)  # (token, choice) rows by expert, tokens in order
        token = order // ids.size(1)
        counts = torch.bincount(choice, minlength=self.moe[0].n)
        got = torch.empty_like(counts)  # got[s * e + j]: the rows rank s sends for local expert j
        dist.all_to_all_single(got, counts, group=self.group)
        got = got.view(self.ep, self.e)
        send = counts.view(self.ep, self.e).sum(1).tolist()
        recv = got.sum(1).tolist()
        rows = flat.index_select(0, token)
        received = all_to_all_single_autograd(rows.new_empty(sum(recv), rows.size(1)), rows, recv, send,
                                              group=self.group)
        # Source-major (each source's rows by expert) to expert-major (expert j's rows from rank 0,
        # then rank 1, ...).
        lens = got.flatten()
        starts = (torch.cumsum(lens, 0) - lens).view(self.ep, self.e).t().flatten()
        lens_em = got.t().flatten()
        at = torch.cumsum(lens_em, 0) - lens_em
        perm = (torch.arange(int(lens.sum())) + torch.repeat_interleave(starts - at, lens_em))
        per_expert = got.sum(0).tolist()
        out = self.run(received.index_select(0, perm), per_expert)
        back = out.index_select(0, torch.argsort(perm))
        returned = all_to_all_single_autograd(rows.new_empty(rows.shape), back, send, recv, group=self.group)
        weighted = (returned.float() * weights.reshape(-1).index_select(0, order).unsqueeze(1)).to(x.dtype)
        out = torch.zeros_like(flat).index_add(0, token, weighted)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(x.shape)

    def run(self, x, counts):
        """The local experts on their contiguous rows, one SwiGLU each."""
        w1, w2, w3 = (w.unbind(0) for w in (self.experts.w1, self.experts.w2, self.experts.w3))
        outs = [F.linear(F.silu(F.linear(r, w1[j])) * F.linear(r, w3[j]), w2[j])
                for j, r in enumerate(torch.split(x, counts))]
        return torch.cat(outs)


def expert_parallel(model, group):
    """Puts every mixture-of-experts block of `model` under expert parallelism over `group`; returns
    the names of the expert weights, which each rank holds its own block of."""
    names = []
    for fqn, m in list(model.named_modules()):
        if type(m).__name__ == "LlamaMoE":
            parent, attr = fqn.rsplit(".", 1)
            model.get_submodule(parent).register_module(attr, ExpertParallelMoE(m, group))
            names += [f"{fqn}.experts.{w}" for w in ("w1", "w2", "w3")]
    if not names:
        raise Unsupported("expert_parallel on a model without mixture-of-experts blocks")
    return names

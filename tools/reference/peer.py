#!/usr/bin/env python3
"""A second reference for composer's parallel runs: PyTorch's own parallelisms.

Given the output directory of a composer run of a parallel config
(config.resolved.json, with its mesh and parallel plan, and init.safetensors),
trains the same model from the same weights and data as a real multi-process
job on Gloo on CPU (one forked process per rank), with PyTorch's own
implementations of the plan: tensor_parallel as
torch.distributed.tensor.parallel.parallelize_module (ColwiseParallel,
RowwiseParallel, SequenceParallel, PrepareModuleInput; the plans of PyTorch's
tests and torchtitan), fully_shard as torch.distributed.fsdp.fully_shard (FSDP2;
HSDP on a 2-D mesh; MixedPrecisionPolicy; the all-gather extensions as
fsdp_pre_all_gather / fsdp_post_all_gather hooks), replicate as
DistributedDataParallel (after tensor_parallel, the FSDP-based composable
replicate), pipeline as torch.distributed.pipelining (PipelineStage and its
schedules), and expert_parallel as torchtitan dispatches tokens, in plain
PyTorch (the experts split over the ep ranks, the tokens sent to their experts
and back with all_to_all_single, the expert gradients divided by ep and the
rest averaged by DistributedDataParallel). It writes a golden file in
composer's format for `composer check --set check.golden=PATH`:

    .venv/bin/python tools/reference/peer.py --run-dir runs/x --golden /tmp/x.peer.json

Conventions, as composer's (docs/launching.md, docs/composition.md#pipeline): the
data-parallel ranks (every mesh dim a replicate, fully_shard or expert_parallel names) take
contiguous slices of each step's global batch; the logged loss is the global
batch's loss, whose gradient PyTorch's averaging over the data-parallel ranks
reproduces (a `sum` loss is multiplied by the data-parallel size to undo that
average); the gradient norm is the full model's. A plan PyTorch 2.11 cannot run
or computes wrongly here is refused (exit 2) with the reason. Two adaptations
make the rest run on Gloo, each explained where it is made: ScheduleZBVZeroBubble's
connection warm-up skips the messages a rank would send itself, and a pipeline
stage whose output is a view returns a copy.
"""
import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import socket
import struct
import sys
import tempfile
import time
import traceback
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed import pipelining
from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_with_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import stage as pipeline_stage
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402
from reference import DTYPES, Data, build_model, load_config, loss_fn, make_optimizer, make_scheduler  # noqa: E402


from peer_plan import (Stage, Unsupported, custom_tp_plan, expert_parallel, local_heads, split_stages,  # noqa: E402
                       tp_plan, units)


def gather_everything_muon():
    """Distributed Muon as a PyTorch user writes it over FSDP2 or DTensor tensor parallelism today
    (torch.optim.Muon has none): each sharded matrix's update all-gathered whole onto every rank
    (full_tensor), orthogonalised there by torch.optim.Muon's own function, and each rank's torch.chunk
    piece kept. Every rank gathers and iterates every matrix."""
    import torch.optim._muon as muon_module
    whole = muon_module._zeropower_via_newtonschulz  # the reference's float32 variant when ns_dtype asks

    def distributed(grad, *args):
        if not isinstance(grad, DTensor):
            return whole(grad, *args)
        x = whole(grad.full_tensor(), *args)
        mesh = grad.device_mesh
        for d, placement in enumerate(grad.placements):
            if placement.is_shard():
                x = x.chunk(mesh.size(d), placement.dim)[mesh.get_local_rank(d)]
        return DTensor.from_local(x.contiguous(), mesh, grad.placements, run_check=False, shape=grad.shape,
                                  stride=grad.stride())

    if getattr(whole, "gathers", False):
        return
    distributed.gathers = True
    muon_module._zeropower_via_newtonschulz = distributed


# ---- the parallel plan -------------------------------------------------------------

class Plan:
    """The resolved config's plan as PyTorch would run it: mesh dims and options of each transform."""

    def __init__(self, cfg):
        mesh = cfg["mesh"]
        self.shape, self.names = mesh["shape"] or [1], mesh["names"] or ["dp"]
        self.tp = self.fsdp = self.ddp = self.pp = self.ep = None
        for t in cfg["parallelize"]:
            (kind, o), = t.items()
            if kind == "tensor_parallel":
                self.tp = o
            elif kind == "fully_shard":
                self.fsdp = o
            elif kind == "replicate":
                self.ddp = o
            elif kind == "pipeline":
                self.pp = o
            elif kind == "expert_parallel":
                self.ep = o
            else:
                raise Unsupported(f"transform {kind}")
        if self.ep and (self.tp or self.fsdp or self.ddp or self.pp):
            raise Unsupported("expert_parallel with other transforms (only expert_parallel alone is written here)")
        f = self.fsdp
        split_backward = self.pp and self.pp["schedule"] in ("interleaved_zero_bubble", "zbv")
        if split_backward and self.ddp:
            # PyTorch's test_pp_ddp skips this case too.
            raise Unsupported("DistributedDataParallel under a zero-bubble schedule: the schedule's input and weight "
                              "gradients bypass autograd.backward, so DDP's reducer never runs (pytorch/pytorch#144530)")
        if split_backward and f and f["reshard_after_forward"]:
            # Observed with torch 2.11 on Gloo: the last stage's parameters end the step with no gradient and
            # the others' gradients are partial; PyTorch's test_pp_fsdp uses reshard_after_forward=False.
            raise Unsupported("fully_shard with reshard_after_forward under a zero-bubble schedule loses the "
                              "deferred weight gradients in torch 2.11")
        if self.ddp and self.fsdp:
            # replicate after fully_shard is HSDP: PyTorch spells it as fully_shard on a 2-D mesh.
            self.fsdp = dict(self.fsdp, mesh_dim=self.ddp["mesh_dim"] + self.fsdp["mesh_dim"])
            self.ddp = None
        self.dp_dims = [n for n in self.names
                        if any(o and n in o["mesh_dim"] for o in (self.fsdp, self.ddp, self.ep))]
        self.tp_dim = self.tp["mesh_dim"][0] if self.tp else None
        self.pp_dim = self.pp["mesh_dim"][0] if self.pp else None
        self.ep_dim = self.ep["mesh_dim"][0] if self.ep else None
        self.dp_size = self.size(self.dp_dims)
        self.world = math.prod(self.shape)

    def size(self, dims):
        return math.prod(self.shape[self.names.index(n)] for n in dims)

    def describe(self):
        """What PyTorch runs, in its own terms."""
        out = []
        if self.tp:
            out.append("parallelize_module over %s (%d)%s" % (
                self.tp_dim, self.size([self.tp_dim]), ", custom plan" if self.tp["plan"] == "custom" else
                (", sequence parallel" if self.tp["sequence_parallel"] else "")))
        f = self.fsdp
        if f:
            opts = ["units %s" % f["units"], "reshard_after_forward=%s" % f["reshard_after_forward"]]
            if f["param_dtype"]:
                opts.append("MixedPrecisionPolicy(%s, %s)" % (f["param_dtype"], f["reduce_dtype"] or f["param_dtype"]))
            if f["all_gather"] != "plain":
                opts.append("fsdp_pre/post_all_gather %s" % f["all_gather"])
            if f["shard_placement"] != "dim0":
                opts.append("shard_placement_fn " + f["shard_placement"])
            if f["offload"] != "none":
                opts.append("CPUOffloadPolicy")
            dims = f["mesh_dim"]
            out.append("fully_shard over %s (%s)%s, %s" % (
                "x".join(dims), "x".join(str(self.size([d])) for d in dims), " (HSDP)" if len(dims) > 1 else "",
                ", ".join(opts)))
        if self.ddp:
            dims = self.ddp["mesh_dim"]
            out.append(("replicate (FSDP-based) over %s (%d)" if self.tp else
                        "DistributedDataParallel over %s (%d)") % ("x".join(dims), self.size(dims)))
        if self.ep:
            out.append("experts over %s (%d), tokens by all_to_all_single, DistributedDataParallel for the rest"
                       % (self.ep_dim, self.size([self.ep_dim])))
        if self.pp:
            out.append("PipelineStage + %s over %s (%d), %d stage(s) per rank" % (
                SCHEDULES[self.pp["schedule"]], self.pp_dim, self.size([self.pp_dim]),
                2 if self.pp["schedule"] == "zbv" else self.pp["virtual_stages"]))
        return "; ".join(out)

    def coords(self, rank):
        out, r = {}, rank
        for n, s in reversed(list(zip(self.names, self.shape))):
            out[n] = r % s
            r //= s
        return out

    def dp_rank(self, rank):
        c, i = self.coords(rank), 0
        for n in self.dp_dims:
            i = i * self.shape[self.names.index(n)] + c[n]
        return i


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "looped_bfs": "ScheduleLoopedBFS", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble"}


def stage_ids(schedule, pp, v, r):
    """The stages rank r holds: a loop (r, r + pp, ...), or zbv's V (r, 2 pp - 1 - r)."""
    if schedule == "zbv":
        return [r, 2 * pp - 1 - r]
    return [r + k * pp for k in range(v)]


def skip_self_warmup():
    """ScheduleZBVZeroBubble's V puts consecutive stages on one rank, and the schedule's first step
    opens the pipeline's connections by sending each neighbouring stage a message, to itself too;
    Gloo has no pair from a rank to itself and fails ("[enforce fail at .../gloo/transport/tcp/
    pair.cc:789] state_ >= CONNECTED. 1 vs 4. Pair is not connected"). The schedule itself passes
    activations between a rank's own stages without messages, so only those warm-up messages to
    itself are dropped."""
    init_ops = pipeline_stage._PipelineStageBase._get_init_p2p_neighbors_ops

    def without_self(self):
        return [op for op in init_ops(self) if op.group_peer != self.group_rank]
    pipeline_stage._PipelineStageBase._get_init_p2p_neighbors_ops = without_self


def all_gather_extension(shard, kind):
    """fully_shard's all-gather extension hooks (fsdp_pre_all_gather / fsdp_post_all_gather, the
    interface of PyTorch's test_fully_shard_extensions) set on a plain local shard, which FSDP2's lazy
    init picks up: `bfloat16` gathers the shard in bfloat16 and computes with it upcast;
    `split_bfloat16` gathers the bfloat16 part and the float32 remainder and adds them back."""
    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size()) if len(outer_size) else 0
        x = self
        if x.dim() and x.size(0) < rows:  # an uneven shard gathers at the padded size
            x = torch.cat([x, x.new_zeros((rows - x.size(0),) + tuple(x.shape[1:]))])
        hi = x.to(torch.bfloat16)
        return ((hi,) if kind == "bfloat16" else (hi, x - hi.to(x.dtype))), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        value = outputs[0].to(param_dtype) if kind == "bfloat16" else outputs[0].to(param_dtype) + outputs[1]
        if out is not None:  # a later gather into the unsharded parameter's storage, as FSDP2 writes it
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(value)
            return None
        return value, (value,)
    shard.fsdp_pre_all_gather = types.MethodType(pre, shard)
    shard.fsdp_post_all_gather = types.MethodType(post, shard)


def apply_fully_shard(module, plan, mesh, mp_policy):
    f = plan.fsdp
    dims = f["mesh_dim"]
    sub = mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]]
    kw = {"mesh": sub, "reshard_after_forward": f["reshard_after_forward"]}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if f["offload"] == "cpu":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if f["shard_placement"] == "opposite_tp":
        def placement(p):  # PyTorch's 2-D test: shard the dim tensor parallelism does not
            if isinstance(p, DTensor):
                for pl in p.placements:
                    if isinstance(pl, Shard):
                        return Shard(p.ndim - 1 - pl.dim)
            return Shard(0)
        kw["shard_placement_fn"] = placement
    for _, m in units(module, f["units"]):
        fully_shard(m, **kw)
    fully_shard(module, **kw)
    if f["all_gather"] != "plain":
        for p in module.parameters():
            all_gather_extension(p._local_tensor, f["all_gather"])


# ---- one rank ------------------------------------------------------------------------

def local_part(t):
    """A DTensor's local shard (a view of it), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def full_value(p):
    t = p.full_tensor() if isinstance(p, DTensor) else p
    return t.detach().clone()


def grad_norm_sq(params):
    """The squared 2-norm of these parameters' gradients over the mesh (DTensors reduce themselves)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        if g is None:
            continue
        g = g.detach().float() if g.dtype == torch.bfloat16 else g.detach()  # as composer and reference.py
        n = g.norm(2)
        total += (n.full_tensor() if isinstance(n, DTensor) else n).double() ** 2
    return total


def worker(rank, cfg, run_dir, golden, init_file, command, threads, timings, dcp_save=None):
    torch.set_num_threads(threads)
    plan = Plan(cfg)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=plan.world)
    try:
        train(rank, cfg, run_dir, golden, plan, command, timings, dcp_save)
    except Unsupported as e:
        if rank == 0:
            sys.stderr.write(f"peer: {cfg['name']}: not run with PyTorch's parallelisms: {e}\n")
        sys.exit(2)
    except Exception:
        sys.stderr.write(f"peer: rank {rank}: " + traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


# ---- timings (--timings), measured as composer's metrics measure them --------

def reset_peak_rss():
    """Resets VmHWM to the current RSS after giving freed heap back (composer's reset_peak_rss)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return -1.0


TCPI_BYTES_SENT = 200  # offsetof(struct tcp_info, tcpi_bytes_sent) on Linux >= 4.19


def tcp_tx_bytes():
    """Bytes this process's TCP sockets have sent (the kernel's per-socket counters)."""
    sent = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:  # the directory's own descriptor, closed by now
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # not a socket
            os.close(fd)
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                if len(info) >= TCPI_BYTES_SENT + 8:
                    sent += struct.unpack_from("<Q", info, TCPI_BYTES_SENT)[0]
        except OSError:
            pass
        finally:
            s.close()
    return sent


def save_torchtitan_dcp(folder, model, opt, scheduler, step, plan, rank, cfg):
    """dcp.save of the training at `step` into `folder`, laid out as torchtitan's checkpointer lays out
    its step-N (components/checkpoint.py): the model's state dict at the top level, the optimizer's
    flattened state dict under optimizer (optimizer.state.<fqn>.<name>, optimizer.param_groups.<fqn>.<key>),
    the LR scheduler's state dict under lr_scheduler, each data-parallel rank's dataloader state under
    dataloader.dp_rank_<i>, and train_state's step and ntokens_seen."""
    import io
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    if plan.pp or isinstance(model, DDP) or not isinstance(opt, torch.optim.Optimizer):
        raise Unsupported("--dcp-save takes a plan without pipeline or replicate, and a torch.optim optimizer")
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    if cfg["model"]["name"] == "llama":  # torchtitan main's (b5bcd76) Llama 3 names, which tools/dcp_import.py renames

        def titan(fqn):
            for w in ("wq", "wk", "wv"):
                fqn = fqn.replace(f".attention.{w}.", f".attention.qkv_linear.{w}.")
            return "lm_head." + fqn[len("output."):] if fqn.startswith("output.") else fqn

        model_sd = {titan(k): v for k, v in model_sd.items()}
        optim_sd = {k.split(".", 1)[0] + "." + titan(k.split(".", 1)[1]): v for k, v in optim_sd.items()}
    t = cfg["train"]
    loader = io.BytesIO(json.dumps({"step": step, "dp_rank": plan.dp_rank(rank)}).encode())
    state = dict(model_sd)
    state.update({"optimizer": optim_sd, "lr_scheduler": scheduler.state_dict(),
                  "dataloader": {"dp_rank_%d" % plan.dp_rank(rank): loader},
                  "train_state": {"step": torch.tensor(step, dtype=torch.int32),
                                  "ntokens_seen": torch.tensor(step * t["global_batch"] * cfg["data"]["seq_len"])}})
    dcp.save(state, checkpoint_id=folder)
    if rank == 0:
        print(f"peer: saved step {step} with dcp.save in torchtitan's layout to {folder}", flush=True)


def train(rank, cfg, run_dir, golden, plan, command, timings=None, dcp_save=None):
    t = cfg["train"]
    dtype = DTYPES[t["dtype"]]
    mesh = init_device_mesh("cpu", tuple(plan.shape), mesh_dim_names=tuple(plan.names))
    coords = plan.coords(rank)
    model = build_model(cfg, run_dir, "peer")
    order = [n for n, _ in model.named_parameters()]
    tied = {}  # parameter id -> its FQNs, for weights tied across modules
    for n, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(n)
    tied = [names for names in tied.values() if len(names) > 1]

    if plan.tp:
        tp_mesh = mesh[plan.tp_dim]
        tp_plan_ = (custom_tp_plan(plan.tp["styles"]) if plan.tp["plan"] == "custom"
                    else tp_plan(cfg, plan.tp["sequence_parallel"]))
        parallelize_module(model, tp_mesh, tp_plan_)
        local_heads(model, tp_mesh.size())
        if cfg["model"]["name"] == "transformer" and cfg["model"]["args"]["weight_tying"]:
            model.output.weight = model.tok_embeddings.weight  # as Transformer.parallelize re-ties them

    experts, ep_group = set(), None
    if plan.ep:
        # The dispatch's all-to-alls on a group of their own (torchtitan's come from the ep mesh's, its
        # gradient reductions from FSDP's), so that they never queue behind DDP's bucket all-reduces.
        ep_group = dist.new_group(list(range(plan.world)), backend="gloo")
        experts = set(expert_parallel(model, ep_group))

    mp_policy = None
    policy = {}  # the rounding the golden's header names, as reference.py's does
    if plan.fsdp and plan.fsdp["param_dtype"]:
        pd = plan.fsdp["param_dtype"]
        rd = plan.fsdp["reduce_dtype"] or pd
        mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[pd], reduce_dtype=DTYPES[rd])
        policy = {"param_dtype": pd, "reduce_dtype": rd}
    elif plan.fsdp and plan.fsdp["all_gather"] == "bfloat16":  # split_bfloat16 is exact
        policy = {"all_gather": "bfloat16"}

    def data_parallel(module):
        if plan.fsdp:
            apply_fully_shard(module, plan, mesh, mp_policy)
            return module
        if plan.ddp:
            dims = plan.ddp["mesh_dim"]
            sub = mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]]
            if plan.tp:
                # After tensor parallelism: the FSDP-based composable replicate, which keeps the DTensor
                # parameters (DistributedDataParallel(device_mesh=...) swaps them for local tensors and, on
                # the tied Transformer, fails in its first broadcast: "aten.cat.default: got mixed
                # torch.Tensor and DTensor").
                return replicate_with_fsdp(module, mesh=sub)
            if sub.ndim > 1:
                raise Unsupported("replicate over several mesh dims")
            return DDP(module, process_group=sub.get_group(), bucket_cap_mb=plan.ddp["bucket_mb"])
        if plan.ep:
            # Every rank holds its own experts: DDP averages the rest over ep and leaves them alone. The
            # buffers (Llama's rotary table) are the same everywhere and never change: not broadcast.
            DDP._set_params_and_buffers_to_ignore_for_model(module, sorted(experts))
            return DDP(module, process_group=mesh[plan.ep_dim].get_group(), broadcast_buffers=False)
        return module

    steps, B, M = t["steps"], t["global_batch"], t["microbatches"]
    dp = plan.dp_size
    local_b = B // dp
    base = plan.dp_rank(rank) * local_b
    data = Data(cfg, dtype)
    lcfg = t["loss"]
    # The rank whose loss counts once in the global-batch loss: tensor-parallel ranks repeat it.
    counts = plan.tp is None or coords[plan.tp_dim] == 0

    if plan.pp:
        p = dict(plan.pp)
        pp = plan.shape[plan.names.index(plan.pp_dim)]
        p["pp"] = pp
        stage_fqns, kind = split_stages(cfg, model, p)
        # A weight tied across stages (the Transformer's output and token embedding) becomes one
        # parameter per FQN, as it would be on separate ranks: PipelineStage owns its module's
        # parameters (it divides each stage's gradients by the microbatches, so a parameter two
        # stages of a rank share would be divided twice). After each step the copies' gradients are
        # summed over the pp ranks; the first FQN's copy counts in the norm and the final weights.
        copies = []
        for names in tied:
            for n in names[1:]:
                owner, attr = n.rsplit(".", 1)
                orig = model.get_parameter(n)
                model.get_submodule(owner).register_parameter(attr, nn.Parameter(orig.detach().clone()))
            zeros = torch.zeros_like(model.get_parameter(names[0]))
            if plan.fsdp:  # a rank without a copy adds zeros shaped as a copy's local shard
                shard_dim = plan.fsdp["mesh_dim"][-1]
                n = plan.shape[plan.names.index(shard_dim)]
                zeros = (list(torch.chunk(zeros, n)) + [zeros[:0]] * n)[coords[shard_dim]]
            copies.append((names, zeros))
        n_stages = len(stage_fqns)
        pp_rank = coords[plan.pp_dim]
        ids = stage_ids(p["schedule"], pp, n_stages // pp, pp_rank)
        pp_group = mesh[plan.pp_dim].get_group()
        modules, stages = [], []
        for s in ids:
            sm = data_parallel(Stage(model, stage_fqns[s], kind, cfg["data"]["seq_len"]))
            modules.append(sm)
            stages.append(pipelining.PipelineStage(sm, s, n_stages, torch.device("cpu"), group=pp_group))
        n_mb = p["microbatches"] or (M if M > 1 else (2 * pp if p["schedule"] == "zbv" else pp))
        mb = local_b // n_mb

        def pipe_loss(out, y):
            # The microbatch's loss as a PyTorch user writes it (the schedule scales the gradients by
            # 1 / microbatches when scale_grads); a sum is made the global batch's (see the docstring).
            with torch.no_grad():
                reported.append(loss_fn(lcfg, out, y, mb, B).item())
            loss = loss_fn(lcfg, out, y, mb, mb)
            return loss * dp if lcfg["name"] == "sum" else loss

        if p["schedule"] == "zbv":
            skip_self_warmup()
        cls = getattr(pipelining, SCHEDULES[p["schedule"]])
        sched = cls(stages if len(stages) > 1 else stages[0], n_microbatches=n_mb, loss_fn=pipe_loss,
                    scale_grads=p["scale_grads"])
        first = 0 in ids
        last = n_stages - 1 in ids
    else:
        modules = [data_parallel(model)]
        first = True

    # This rank's parameters, once each, by their first FQN.
    local = {}
    for sm in modules:
        inner = sm.module if isinstance(sm, DDP) else sm
        for n, q in inner.named_parameters():
            if all(q is not x for x in local.values()):
                local[n] = q
    params = list(local.values())
    copied = {n for names, _ in copies for n in names[1:]} if plan.pp else set()
    normed = [q for n, q in local.items() if n not in copied and n not in experts]
    local_experts = [q for n, q in local.items() if n in experts]  # this rank's block of each expert weight
    opt = make_optimizer(t["optimizer"], params, list(local.keys()))
    if t["optimizer"]["name"] == "muon":
        gather_everything_muon()
    scheduler = make_scheduler(opt, t["optimizer"], t["lr_schedule"], t["steps"])
    max_norm = t["grad_clip"] if t["grad_clip"] > 0 else math.inf
    records = []
    timing = []
    if timings:
        gc.collect()
        reset_peak_rss()
    for step in range(1, steps + 1):
        start = time.perf_counter()
        tcp_start = tcp_tx_bytes() if timings and rank == 0 and plan.world > 1 else None
        lr = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        reported = []
        if plan.pp:
            x, y = data.batch(step, base, base + local_b)
            if y is None:
                y = torch.zeros(local_b)
            args = (x,) if first else ()
            kw = {"target": y, "losses": []} if last else {}
            sched.step(*args, **kw)
            for names, zeros in copies:
                held = [local_part(local[n].grad) for n in names if n in local]
                g = sum(held, torch.zeros_like(zeros))
                dist.all_reduce(g, group=pp_group)
                for h in held:
                    h.copy_(g)
        else:
            mb = local_b // M
            for m in range(M):
                x, y = data.batch(step, base + m * mb, base + (m + 1) * mb)
                sync = not isinstance(modules[0], DDP) or m == M - 1
                with contextlib.nullcontext() if sync else modules[0].no_sync():
                    out = modules[0](x)
                    loss = loss_fn(lcfg, out, y, mb, B)
                    reported.append(loss.item())
                    (loss * dp if dp > 1 else loss).backward()
            # An expert's gradient already sums every rank's tokens routed to it, each rank's loss
            # being ep x its share of the batch's: divided by ep, as composer does.
            for q in local_experts:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                else:
                    q.grad.div_(plan.size([plan.ep_dim]))
        total = torch.tensor([sum(reported) if counts else 0.0], dtype=torch.float64)
        dist.all_reduce(total)
        sq = grad_norm_sq(normed)
        if plan.pp:
            dist.all_reduce(sq, group=pp_group)  # the other stages' gradients
        if local_experts:
            sq_experts = grad_norm_sq(local_experts)
            dist.all_reduce(sq_experts, group=ep_group)  # the other ranks' experts
            sq += sq_experts
        norm = math.sqrt(sq.item())
        if max_norm < math.inf:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm, dtype=torch.float32),
                                                 foreach=False)
        opt.step()
        scheduler.step()
        records.append({"step": step, "loss": total.item(), "grad_norm": norm, "lr": lr})
        if dcp_save and step == dcp_save[0]:
            save_torchtitan_dcp(dcp_save[1], modules[0], opt, scheduler, step, plan, rank, cfg)
        if timings:
            ms = (time.perf_counter() - start) * 1000.0
            timing.append({"step": step, "loss": total.item(), "step_ms": ms, "samples_per_s": B * 1000.0 / ms,
                           "peak_rss_mb": peak_rss_mb(), "wall_time": time.time(),
                           **({"tcp_tx_bytes": tcp_tx_bytes() - tcp_start} if tcp_start is not None else {})})
        if rank == 0:
            print(f"peer step {step}/{steps} loss {total.item():.6g} grad_norm {norm:.4g}")

    if timings and rank == 0:
        with open(timings, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in timing)
    if not golden:
        return
    # Final parameters: full values, the pp ranks' stages gathered on rank 0.
    mine = {}
    for n, q in local.items():
        if n in experts:  # every rank's block of the experts, in rank order
            parts = [torch.empty_like(q) for _ in range(plan.world)]
            dist.all_gather(parts, q.detach().contiguous(), group=ep_group)
            mine[n] = torch.cat(parts)
        else:
            mine[n] = full_value(q)
    holder = all(coords[d] == 0 for d in plan.names if d != plan.pp_dim)
    gathered = [None] * plan.world
    dist.all_gather_object(gathered, mine if holder else {})
    if rank == 0:
        final = {}
        for part in gathered:
            for n, v in part.items():
                final.setdefault(n, v)
        missing = [n for n in order if n not in final]
        if missing:
            raise RuntimeError(f"no rank holds {missing}")
        reference.write_golden(golden, cfg, records, [(n, final[n]) for n in order], "pytorch-peer", command,
                               policy, who="peer")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="composer output directory of a run of the parallel config")
    ap.add_argument("--golden", help="golden file to write")
    ap.add_argument("--timings", help="metrics file (JSON lines) to write: rank 0's step_ms, samples_per_s, "
                    "peak_rss_mb and tcp_tx_bytes per step, measured as composer measures them")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    ap.add_argument("--dcp-save", metavar="STEP:DIR", help="also save step STEP with dcp.save into DIR, laid out as "
                    "torchtitan's checkpoints are (model, optimizer, lr_scheduler, dataloader, train_state)")
    args = ap.parse_args()
    if not args.golden and not args.timings:
        ap.error("give --golden, --timings or both")
    cfg = load_config(args.run_dir)
    try:
        plan = Plan(cfg)
    except Unsupported as e:
        sys.stderr.write(f"peer: {cfg['name']}: not run with PyTorch's parallelisms: {e}\n")
        sys.exit(2)
    command = "tools/reference/peer.py --run-dir " + args.run_dir
    dcp_save = None
    if args.dcp_save:
        at, _, folder = args.dcp_save.partition(":")
        if not at.isdigit() or not folder:
            ap.error("--dcp-save takes STEP:DIR, e.g. 3:/tmp/tt/step-3")
        dcp_save = (int(at), os.path.abspath(folder))
    print(f"peer: {cfg['name']} on {plan.world} Gloo ranks: {plan.describe()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="peer") as tmp:
        # Forked ranks share the parent's imported torch (no per-rank import); the parent has
        # started no intra-op threads. A forked rank that a signal kills (a crash inside PyTorch or
        # Gloo, never a wrong result) is run once more with freshly spawned ranks, which import
        # torch themselves, and said so.
        for attempt, method in enumerate(["fork", "spawn"]):
            try:
                mp.start_processes(worker, args=(cfg, args.run_dir, args.golden, os.path.join(tmp, f"store{attempt}"),
                                                 command, args.threads, args.timings, dcp_save),
                                   nprocs=plan.world, start_method=method)
                break
            except mp.ProcessRaisedException as e:
                sys.exit(f"peer: {cfg['name']}: rank {e.error_index} failed (traceback above)")
            except mp.ProcessExitedException as e:
                if e.exit_code == 2:
                    sys.exit(2)
                if method == "fork" and e.signal_name:
                    print(f"peer: {cfg['name']}: forked rank {e.error_index} died of {e.signal_name}; "
                          "running every rank again, spawned", flush=True)
                    continue
                sys.exit(f"peer: {cfg['name']}: {e}")


if __name__ == "__main__":
    main()

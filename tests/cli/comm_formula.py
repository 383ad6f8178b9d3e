#!/usr/bin/env python3
"""Each collective `composer plan` reports against its closed form, from the model's arguments.

    comm_formula.py COMPOSER WORK_DIR

For the Llama and the Transformer, small and in float32: tensor parallelism with and without
sequence parallelism (and Llama's loss parallelism), replicate, fully_shard, a 1F1B pipeline,
context parallelism (a load-balanced ring over cp 2 and 4, and all-to-all over cp 2 and 4 where the
heads divide), on a mixture-of-experts Llama,
expert parallelism over ep 2 and 4, and Muon's whole-matrix gathers and scatters.
Every group's every collective kind must equal the formula, and no other may appear. Bytes are the
payload a rank hands the collective per step (an all-gather: this rank's piece; a reduce-scatter:
the whole input; an all-reduce: the tensor), as docs/memory.md defines them.
"""
import json
import os
import subprocess
import sys

composer, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
F32, F64 = 4, 8
B, S = 4, 16  # global batch, sequence
T = B * S     # tokens per step on one rank when the batch is not split
STEP_CHECK = 3 * F64  # world all-reduce of the step's (squared norm, non-finite, stop) doubles
LOSS = F64            # the data-parallel loss all-reduce


def llama_sizes(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=64, multiple_of=32):
    hd = dim // n_heads
    hidden = int(2 * 4 * dim / 3)
    hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
    layer = [dim * dim, n_kv_heads * hd * dim, n_kv_heads * hd * dim, dim * dim,
             hidden * dim, dim * hidden, hidden * dim, dim, dim]
    root = [vocab * dim, dim, vocab * dim]  # tok_embeddings, norm, output
    return dict(dim=dim, L=n_layers, vocab=vocab, layer=layer, root=root,
                args=dict(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab,
                          multiple_of=multiple_of, max_seq_len=32))


def transformer_sizes(dim=32, n_layers=2, vocab=64, max_seq_len=16):
    hidden = 4 * dim
    layer = [dim, dim, dim * dim, dim * dim, dim * dim, dim * dim, dim, dim,
             hidden * dim, hidden, dim * hidden, dim]  # norms (weight, bias), wq wk wv wo, ffn (w, b)
    root = [vocab * dim, max_seq_len * dim, dim, dim]  # tok (and the tied output), pos, norm
    return dict(dim=dim, L=n_layers, vocab=vocab, layer=layer, root=root,
                args=dict(dim=dim, n_layers=n_layers, n_heads=4, vocab_size=vocab, max_seq_len=max_seq_len,
                          dropout_p=0.0))


def plan(name, model, m, mesh, names, transform, microbatches=None, optimizer=None):
    cfg = {"name": name, "seed": 0, "model": {"name": model, "args": m["args"]},
           "mesh": {"shape": mesh, "names": names},
           "parallelize": transform if isinstance(transform, list) else [transform],
           "train": {"steps": 2, "global_batch": B, "optimizer": optimizer or {"name": "sgd", "lr": 0.1},
                     "loss": {"name": "cross_entropy"}},
           "data": {"seq_len": S}}
    path = os.path.join(work, name + ".yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)  # JSON is YAML
    out = subprocess.run([composer, "plan", "--config", path, "--json"], check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    global last_json
    last_json = json.loads(out)
    return [r["comm"] for r in last_json["ranks"]]


failures = 0


def expect(name, ranks, want):
    global failures
    bad = 0
    for r, got in enumerate(ranks):
        if got != want:
            bad += 1
            print(f"FAIL {name} rank {r}: plan {json.dumps(got, sort_keys=True)} != formula {json.dumps(want, sort_keys=True)}")
    failures += bad
    if not bad:
        print(f"ok: {name}, {len(ranks)} ranks: {json.dumps(ranks[0], sort_keys=True)}")


ll = llama_sizes()
D, L, V = ll["dim"], ll["L"], ll["vocab"]
A = T * D * F32  # one activation [tokens, dim]
params = sum(ll["layer"]) * L + sum(ll["root"])
n_params = len(ll["layer"]) * L + len(ll["root"])
world = {"all_reduce": STEP_CHECK}

# Tensor parallelism over tp 2 (torchtitan's plan). Without SP: the rowwise embedding, wo and w2
# all-reduce their partial outputs (1 + 2 per block); backward all-reduces the input gradient of
# each colwise Linear (wq, wk, wv, w1, w3 per block, and the output); the output's logits are
# all-gathered ([tokens, vocab / tp] each). With SP: each block's two inputs are all-gathered once
# along the sequence ([tokens / tp, dim] each) and reduce-scattered in backward; wo and w2 reduce-
# scatter their outputs and all-gather their gradients; the embedding reduce-scatters, the output's
# input is gathered; the norms' replicated weights all-reduce their gradients (with one flag per
# parameter of the gradient bucket). Loss parallelism keeps the logits sharded and all-reduces
# three per-token floats (each row's max, sum of exponentials and target logit) instead.
tp = 2
logits_piece = T * (V // tp) * F32
norms = 2 * L + 1
for sp in (False, True):
    for lp in (False, True):
        name = f"llama_tp2{'_sp' if sp else ''}{'_lp' if lp else ''}"
        got = plan(name, "llama", ll, [tp], ["tp"],
                   {"tensor_parallel": {"mesh_dim": "tp", "sequence_parallel": sp, "loss_parallel": lp}})
        cross_entropy = 3 * T * F32 if lp else 0
        if not sp:
            want = {"all_reduce": (1 + 2 * L) * A + (5 * L + 1) * A + cross_entropy}
            if not lp:
                want["all_gather"] = logits_piece
        else:
            want = {"all_gather": 4 * L * (A // tp) + 2 * (A // tp) + (0 if lp else logits_piece),
                    "reduce_scatter": 4 * L * A + 2 * A,
                    "all_reduce": norms * (D + 1) * F32 + cross_entropy}
        expect(name, got, {"tp": want, "world": world})

# Replicate over dp 2: one all-reduce of every gradient (with a flag per parameter), and the loss.
dp = 2
expect("llama_replicate_dp2", plan("llama_replicate_dp2", "llama", ll, [dp], ["dp"],
                                   {"replicate": {"mesh_dim": "dp"}}),
       {"dp": {"all_reduce": (params + n_params) * F32 + LOSS}, "world": world})

# fully_shard over dp 2, a unit per block and the root's: forward gathers every unit (this rank's
# half), backward re-gathers each block (resharded after forward) but not the root, and reduce-
# scatters every gradient once.
layer_bytes, root_bytes = sum(ll["layer"]) * F32, sum(ll["root"]) * F32
expect("llama_fsdp_dp2", plan("llama_fsdp_dp2", "llama", ll, [dp], ["dp"],
                              {"fully_shard": {"mesh_dim": "dp", "units": ["layers.*"]}}),
       {"dp": {"all_gather": (2 * L * layer_bytes + root_bytes) // dp, "reduce_scatter": params * F32,
               "all_reduce": LOSS}, "world": world})

# A 1F1B pipeline over pp 2 with 2 microbatches: each microbatch's activation [B / 2, S, dim] goes
# forward and its gradient back; the loss with each microbatch's (doubles) is all-reduced and the
# step's (busy, span) times are all-gathered for the bubble. The Transformer's output weight is its
# token embedding's, on both stages: its gradient (and a flag) is summed over the pair that holds it.
M = 2
act = (B // M) * S * D * F32
expect("llama_pp2_1f1b", plan("llama_pp2_1f1b", "llama", ll, [2], ["pp"],
                              {"pipeline": {"mesh_dim": "pp", "schedule": "1f1b", "microbatches": M}}),
       {"pp": {"send": M * act, "recv": M * act, "all_reduce": (1 + M) * F64, "all_gather": 2 * F64},
        "world": world})

tf = transformer_sizes()
D, L, V = tf["dim"], tf["L"], tf["vocab"]
params = sum(tf["layer"]) * L + sum(tf["root"])
n_params = len(tf["layer"]) * L + len(tf["root"])
A = T * D * F32
expect("transformer_replicate_dp2", plan("transformer_replicate_dp2", "transformer", tf, [dp], ["dp"],
                                         {"replicate": {"mesh_dim": "dp"}}),
       {"dp": {"all_reduce": (params + n_params) * F32 + LOSS}, "world": world})
layer_bytes, root_bytes = sum(tf["layer"]) * F32, sum(tf["root"]) * F32
expect("transformer_fsdp_dp2", plan("transformer_fsdp_dp2", "transformer", tf, [dp], ["dp"],
                                    {"fully_shard": {"mesh_dim": "dp", "units": ["layers.*"]}}),
       {"dp": {"all_gather": (2 * L * layer_bytes + root_bytes) // dp, "reduce_scatter": params * F32,
               "all_reduce": LOSS}, "world": world})
act = (B // M) * S * D * F32
expect("transformer_pp2_1f1b", plan("transformer_pp2_1f1b", "transformer", tf, [2], ["pp"],
                                    {"pipeline": {"mesh_dim": "pp", "schedule": "1f1b", "microbatches": M}}),
       {"pp": {"send": M * act, "recv": M * act, "all_reduce": (1 + M) * F64, "all_gather": 2 * F64},
        "pp{0,1}": {"all_reduce": (V * D + 1) * F32}, "world": world})

# The Transformer's tensor parallelism (docs/scenarios.md M4: vocabulary- and position-parallel
# embeddings, the output tied to the token embedding). Without SP: the two embeddings (the
# positions' [S, dim]), wo and w2 all-reduce their outputs; backward all-reduces the input gradient
# of wq, wk, wv, w1 and the output; the logits are gathered. With SP: as the Llama's, with one
# gathered input per block half, the positions reduce-scattered along the sequence, and the
# gradients of the LayerNorms' weights and biases and of w2's bias (added to sequence-sharded
# outputs) all-reduced with their flags.
P_pos = S * D * F32
logits_piece = T * (V // tp) * F32
expect("transformer_tp2", plan("transformer_tp2", "transformer", tf, [tp], ["tp"],
                               {"tensor_parallel": {"mesh_dim": "tp"}}),
       {"tp": {"all_reduce": A + P_pos + 2 * L * A + (4 * L + 1) * A, "all_gather": logits_piece}, "world": world})
expect("transformer_tp2_sp", plan("transformer_tp2_sp", "transformer", tf, [tp], ["tp"],
                                  {"tensor_parallel": {"mesh_dim": "tp", "sequence_parallel": True}}),
       {"tp": {"all_gather": 4 * L * (A // tp) + 2 * (A // tp) + P_pos // tp + logits_piece,
               "reduce_scatter": 4 * L * A + 2 * A + P_pos,
               "all_reduce": ((2 * L + 1) * 2 + L) * (D + 1) * F32}, "world": world})

# Context parallelism (load-balanced ring) over cp 2 and 4: per block, forward passes each rank's
# keys and values (B x kv heads x S / cp x head_dim each) around the ring cp - 1 times; backward
# passes them cp - 1 times again and their float32 gradients cp times (the last hop takes each
# home): 3 cp - 2 hops. The parameters are replicated over cp: their gradients are all-reduced (with
# a flag each), as is the loss.
for model, m in (("llama", ll), ("transformer", tf)):
    heads = m["args"].get("n_kv_heads") or m["args"]["n_heads"]
    hd = m["dim"] // m["args"]["n_heads"]
    n_p = len(m["layer"]) * m["L"] + len(m["root"])
    p_ = sum(m["layer"]) * m["L"] + sum(m["root"])
    for cp in (2, 4):
        kv = 2 * B * heads * (S // cp) * hd * F32
        name = f"{model}_cp{cp}"
        expect(name, plan(name, model, m, [cp], ["cp"], {"context_parallel": {"mesh_dim": "cp"}}),
               {"cp": {"send": (3 * cp - 2) * m["L"] * kv, "recv": (3 * cp - 2) * m["L"] * kv,
                       "all_reduce": (p_ + n_p) * F32 + LOSS}, "world": world})

# All-to-all context parallelism (rotate: alltoall) over cp 2 and 4, where the heads divide: per
# block, forward hands all_to_all this rank's q, k and v (B x heads x S / cp x head_dim; k and v
# with the kv heads) and the attention output (as q); backward the four gradients. No sends.
for model, m in (("llama", ll), ("transformer", tf)):
    H = m["args"]["n_heads"]
    KV = m["args"].get("n_kv_heads") or H
    hd = m["dim"] // H
    n_p = len(m["layer"]) * m["L"] + len(m["root"])
    p_ = sum(m["layer"]) * m["L"] + sum(m["root"])
    for cp in (2, 4):
        if H % cp or KV % cp:
            continue  # refused by the planner (tests/bad_inputs/alltoall_heads.yaml)
        moved = 2 * B * (2 * H + 2 * KV) * (S // cp) * hd * F32
        name = f"{model}_cp{cp}_alltoall"
        expect(name, plan(name, model, m, [cp], ["cp"], {"context_parallel": {"mesh_dim": "cp", "rotate": "alltoall"}}),
               {"cp": {"all_to_all": m["L"] * moved, "all_reduce": (p_ + n_p) * F32 + LOSS}, "world": world})

# Expert parallelism over ep 2 and 4 on a mixture-of-experts Llama (4 experts, top 2, hidden 64),
# under uniform routing (the dry run's): per block, forward exchanges the per-expert counts
# (4 int64), sends this rank's (token, choice) rows and returns the outputs of the rows it received
# (as many, uniformly); backward sends both back. The experts' gradients need no reduction; every
# other parameter's is all-reduced over ep with its flag, as is the loss and each step's routing
# counts ([blocks, experts + 1] doubles, for the metrics and the expert bias).
E, K, H = 4, 2, 64
D, L, V = ll["dim"], ll["L"], ll["vocab"]
moe = dict(ll, args=dict(ll["args"], n_experts=E, top_k=K, moe_hidden_dim=H))
dense = ll["layer"][:4] + ll["layer"][7:]  # attention and the two norms
non_expert = (sum(dense) + E * D) * L + sum(ll["root"])
n_non_expert = (len(dense) + 1) * L + len(ll["root"])
for ep in (2, 4):
    R = (B // ep) * S * K
    name = f"llama_moe_ep{ep}"
    expect(name, plan(name, "llama", moe, [ep], ["ep"], {"expert_parallel": {"mesh_dim": "ep"}}),
           {"ep": {"all_to_all": L * (E * F64 + 4 * R * D * F32),
                   "all_reduce": (non_expert + n_non_expert) * F32 + LOSS + L * (E + 1) * F64}, "world": world})

# Muon (float32 iterations) makes each hidden matrix whole on one owner among the ranks holding its
# pieces and sends the pieces of the result back, point to point: a mesh dim of s ranks that splits
# a matrix moves (s - 1) / s of it to the level's owners, and as much back, so over all ranks a step
# sends (and receives) 2 x sum over matrices of |M| x sum over its splitting dims of (s - 1) / s,
# each dim's traffic on that dim's group; how it spreads over the ranks is the owners' balance.
# The embedding and the output head train with AdamW and move nothing more.
muon = {"name": "muon", "lr": 0.01, "muon": {"ns_dtype": "float32"}}
D, L, V = ll["dim"], ll["L"], ll["vocab"]
matrices = sum(ll["layer"][:7]) * L * F32


def expect_muon(name, base, ranks, levels):
    """Every rank's collectives equal `base`'s (the same plan with SGD), and the sends and receives
    of each group (levels: {group: (s - 1) / s of every matrix}) add up over the ranks to the form."""
    global failures
    bad = []
    for group, share in levels.items():
        for kind in ("send", "recv"):
            got = sum(r.get(group, {}).get(kind, 0) for r in ranks)
            if got != round(2 * matrices * share):
                bad.append(f"{group} {kind}: plan {got} over the ranks, formula {round(2 * matrices * share)}")
        printed = last_json["muon"]["bytes"].get(group, {})
        if printed.get("to_owners", 0) + printed.get("back", 0) != round(2 * matrices * share):
            bad.append(f"{group}: composer plan's closed form {printed} != formula {round(2 * matrices * share)}")
    for r, (got, want) in enumerate(zip(ranks, base)):
        rest = {g: {k: v for k, v in kinds.items() if not (g in levels and k in ("send", "recv"))}
                for g, kinds in got.items()}
        if rest != want:
            bad.append(f"rank {r}: collectives besides Muon's {json.dumps(rest, sort_keys=True)} != "
                       f"SGD's {json.dumps(want, sort_keys=True)}")
    failures += len(bad)
    for b in bad:
        print(f"FAIL {name}: {b}")
    if not bad:
        sends = [sum(r[g].get("send", 0) for g in levels) for r in ranks]
        print(f"ok: {name}, {len(ranks)} ranks: Muon sends {sends} bytes per rank, as the form's total")


for name, mesh, names, transform, levels in (
        ("llama_muon_fsdp_dp2", [2], ["dp"], {"fully_shard": {"mesh_dim": "dp", "units": ["layers.*"]}},
         {"dp": 1 / 2}),
        ("llama_muon_fsdp_dp4", [4], ["dp"], {"fully_shard": {"mesh_dim": "dp", "units": ["layers.*"]}},
         {"dp": 3 / 4}),
        ("llama_muon_tp2_sp", [2], ["tp"], {"tensor_parallel": {"mesh_dim": "tp", "sequence_parallel": True}},
         {"tp": 1 / 2}),
        ("llama_muon_tp2_fsdp2", [2, 2], ["dp", "tp"],
         [{"tensor_parallel": {"mesh_dim": "tp", "sequence_parallel": True}},
          {"fully_shard": {"mesh_dim": "dp", "units": ["layers.*"]}}], {"dp": 1 / 2, "tp": 1 / 2})):
    base = plan(name + "_sgd", "llama", ll, mesh, names, transform)
    expect_muon(name, base, plan(name, "llama", ll, mesh, names, transform, optimizer=muon), levels)

if failures:
    sys.exit(f"{failures} rank(s) differ from the formulas")

"""The seed models in plain PyTorch, with the fully-qualified names and math of
PyTorch's composability tests (see docs/scenarios.md section 0). Written from the
test sources, independently of composer's C++ models."""
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPModule(nn.Module):  # M1 / M3
    def __init__(self, dim=10, hidden=0, kaiming_init=False):
        super().__init__()
        hidden = hidden or dim
        self.net1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class MLPModuleEven(nn.Module):  # M2
    def __init__(self, dim=8):
        super().__init__()
        self.net1 = nn.Linear(dim, dim)
        self.net2 = nn.Linear(dim, dim)
        self.net3 = nn.Linear(dim, dim * 2)

    def forward(self, x):
        return F.relu(self.net3(F.relu(self.net2(F.relu(self.net1(x))))))


class MLPModuleLayers(nn.Module):
    def __init__(self, n_layers=8, dim=10, kaiming_init=False):
        super().__init__()
        self.layers = nn.ModuleList([MLPModule(dim) for _ in range(n_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class MLP(nn.Module):  # M5 (common_fsdp)
    def __init__(self, dim=8, bias=True, dim_multiplier=4):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, bias=bias)

    def forward(self, x):
        z = F.relu(self.in_proj(x))
        return F.relu(self.out_proj(z))


class LayerNormNoBias(nn.Module):
    """nn.LayerNorm(dim, bias=False) for PyTorch versions without the bias flag."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x, (self.weight.numel(),), self.weight, None, self.eps)


def mlp_stack(mlp_dim=16, with_seq_parallel=False):  # M6
    modules = [MLP(mlp_dim, dim_multiplier=3), MLP(mlp_dim), MLP(mlp_dim, dim_multiplier=3)]
    if with_seq_parallel:
        modules.append(LayerNormNoBias(mlp_dim))
    return nn.Sequential(*modules)


def mlp_seq(n_mlps=3, dim=8, bias=False, dim_multiplier=4):  # M16's model, plain tensors
    return nn.Sequential(*[MLP(dim, bias=bias, dim_multiplier=dim_multiplier) for _ in range(n_mlps)])


class SimpleModel(nn.Module):  # M7
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(5, 8)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(8, 4)
        self.net3 = nn.Linear(4, 12)

    def forward(self, x):
        return F.relu(self.net3(F.relu(self.net2(F.relu(self.net1(x))))))


class SimpleModelUneven(nn.Module):  # M8
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(5, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 15)
        self.net3 = nn.Linear(15, 30)
        self.net4 = nn.Linear(30, 5)

    def forward(self, x):
        x = F.relu(self.net1(x))
        x = F.relu(self.net2(x))
        x = F.relu(self.net3(x))
        return self.net4(x)


# ---- M4: the DTensor tests' Transformer ------------------------------------

def attention(q, k, v, causal, dropout_p, training, mask=None):
    # composer calls LibTorch's scaled_dot_product_attention with the same arguments: the same kernel
    # (on the CPU flash attention without dropout, else matmul, softmax, dropout, matmul). A packed
    # documents' mask replaces the causal flag.
    p = dropout_p if training else 0.0
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)


def causal_attention(q, k, v, dropout_p, training, mask=None):
    return attention(q, k, v, True, dropout_p, training, mask)


def document_mask(doc_start, causal):
    """Packed documents (doc_start: (batch, seq), where each token's document begins): a token attends
    to the tokens of its own document (and, causal, not after it). (batch, 1, seq, seq) booleans."""
    same = doc_start[:, :, None] == doc_start[:, None, :]
    if causal:
        n = doc_start.size(1)
        same = same & torch.ones(n, n, dtype=torch.bool).tril()
    return same[:, None]


def set_documents(model, doc_start):
    """The packed documents of the next forward (None: one document per sequence)."""
    model.doc_start = doc_start


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.head_dim = a["dim"] // a["n_heads"]
        self.n_heads = a["n_heads"]
        self.dropout_p = a["dropout_p"]
        self.use_attn_mask = a["use_attn_mask"]
        self.mask = None
        self.resid_dropout = nn.Dropout(a["dropout_p"])
        self.wq = nn.Linear(a["dim"], a["dim"], bias=False)
        self.wk = nn.Linear(a["dim"], a["dim"], bias=False)
        self.wv = nn.Linear(a["dim"], a["dim"], bias=False)
        self.wo = nn.Linear(a["dim"], a["dim"], bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        out = attention(q, k, v, self.use_attn_mask, self.dropout_p, self.training, self.mask)
        out = out.transpose(1, 2).contiguous().view(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(out))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention_norm = nn.LayerNorm(a["dim"])
        self.attention = Attention(a)
        self.ffn_norm = nn.LayerNorm(a["dim"])
        self.feed_forward = FeedForward(a["dim"], 4 * a["dim"], a["dropout_p"])

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, **a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a["vocab_size"], a["dim"])
        self.pos_embeddings = nn.Embedding(a["max_seq_len"], a["dim"])
        self.dropout = nn.Dropout(p=a["dropout_p"])
        self.layers = nn.ModuleList([TransformerBlock(a) for _ in range(a["n_layers"])])
        self.norm = nn.LayerNorm(a["dim"])
        self.output = nn.Linear(a["dim"], a["vocab_size"], bias=False)
        if a["weight_tying"]:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        _bsz, seq_len = tokens.size()
        doc = getattr(self, "doc_start", None)
        h = self.tok_embeddings(tokens)
        # Packed documents: positions restart at each document's start.
        h = h + self.pos_embeddings(torch.arange(0, seq_len) if doc is None else torch.arange(0, seq_len) - doc)
        h = self.dropout(h)
        for layer in self.layers:
            layer.attention.mask = None if doc is None else document_mask(doc, layer.attention.use_attn_mask)
            h = layer(h)
        return self.output(self.norm(h)).float()


# ---- M14: torchtitan's Llama ------------------------------------------------

def rope_scaled(freqs, a):
    """Each rotated pair's frequency after the config's rope scaling, one at a time in Python floats, and the
    factor cos and sin are scaled by: llama3 as Meta's Llama 3.1 apply_scaling, yarn as the YaRN paper
    (DeepSeek-V3's yarn_find_correction_range, linear ramp and mscale)."""
    kind = a.get("rope_type", "default")
    if kind == "default":
        return freqs, 1.0
    factor = a.get("rope_factor", 1.0)
    original = a.get("rope_original_max_seq_len", 0) or a["max_seq_len"]
    out = []
    if kind == "llama3":
        low, high = a.get("rope_low_freq_factor", 1.0), a.get("rope_high_freq_factor", 4.0)
        for f in freqs.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < original / high:
                out.append(f)
            elif wavelen > original / low:
                out.append(f / factor)
            else:
                smooth = (original / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return torch.tensor(out, dtype=torch.float32), 1.0
    assert kind == "yarn", kind
    dim = 2 * len(freqs)
    base = a["rope_theta"]

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction(a.get("rope_beta_fast", 32.0)), correction(a.get("rope_beta_slow", 1.0))
    if a.get("rope_truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    for i, f in enumerate(freqs.tolist()):
        keep = 1 - min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 1: the pair keeps its frequency
        out.append(f / factor * (1 - keep) + f * keep)

    def mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = a.get("rope_attention_factor", 0.0)
    if not scaling:
        m, m_all = a.get("rope_mscale", 0.0), a.get("rope_mscale_all_dim", 0.0)
        scaling = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor, 1)
    return torch.tensor(out, dtype=torch.float32), scaling


def precompute_freqs_cis(dim, end, theta, a=None):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs, scaling = rope_scaled(freqs, a or {})
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.full_like(freqs, scaling), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    # Packed documents give each sample its own positions: (batch, seq, head_dim / 2).
    freqs_cis = freqs_cis.view(freqs_cis.shape[0] if freqs_cis.dim() == 3 else 1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return out * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.n_heads = a["n_heads"]
        self.n_kv_heads = a["n_kv_heads"] or a["n_heads"]
        self.head_dim = a.get("head_dim", 0) or a["dim"] // a["n_heads"]
        self.wq = nn.Linear(a["dim"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, a["dim"], bias=False)
        if a.get("qk_norm"):  # Qwen3: one RMSNorm over each head's dims, before the rotary
            self.q_norm = RMSNorm(self.head_dim, a["norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, a["norm_eps"])
        self.mask = None  # packed documents' (document_mask)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:  # repeat_kv
            xk = xk[:, :, :, None, :].expand(bs, seqlen, self.n_kv_heads, n_rep, self.head_dim)
            xk = xk.reshape(bs, seqlen, self.n_heads, self.head_dim)
            xv = xv[:, :, :, None, :].expand(bs, seqlen, self.n_kv_heads, n_rep, self.head_dim)
            xv = xv.reshape(bs, seqlen, self.n_heads, self.head_dim)
        out = causal_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), 0.0, False, self.mask)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (kv_lora_rank > 0), op by op as transformers'
    DeepseekV3Attention computes it, with composer's interleaved-pair rotary on the qk_rope_head_dim
    part of each head. q: wq(x), or wq_b(q_norm(wq_a(x))) with q_lora_rank; per head [q_nope | q_rot].
    wkv_a(x) = [kv_lat (kv_lora_rank) | k_rot (qk_rope_head_dim)]: kv_norm normalises kv_lat only, and
    k_rot is one head every head shares. wkv_b(kv_lat) per head [k_nope | v]. The softmax scale is
    (nope + rope)^-0.5 times mscale(rope_factor, rope_mscale_all_dim)^2 under a scaled rope; composer
    multiplies q by the square and leaves the kernel its default scale, and so does this."""

    def __init__(self, a):
        super().__init__()
        self.n_heads = a["n_heads"]
        self.nope, self.rope, self.v_dim = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
        self.kv_lora_rank = a["kv_lora_rank"]
        qk = self.nope + self.rope
        if a.get("q_lora_rank", 0):
            self.wq_a = nn.Linear(a["dim"], a["q_lora_rank"], bias=False)
            self.q_norm = RMSNorm(a["q_lora_rank"], 1e-6)  # the latents' norms: 1e-6 whatever norm_eps
            self.wq_b = nn.Linear(a["q_lora_rank"], self.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(a["dim"], self.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(a["dim"], self.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, a["dim"], bias=False)
        m, factor = 1.0, a.get("rope_factor", 1.0)
        if a.get("rope_type", "default") != "default" and a.get("rope_mscale_all_dim", 0.0) and factor > 1:
            m = 0.1 * a["rope_mscale_all_dim"] * math.log(factor) + 1.0
        self.q_scale = m * m
        self.mask = None  # packed documents' (document_mask)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, self.n_heads, self.nope + self.rope)
        q_nope, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)
        kv_lat, k_rot = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope], dim=-1)
        kv_lat = self.kv_norm(kv_lat)
        k_rot = k_rot.view(bs, seqlen, 1, self.rope)  # one head, shared by every head
        q_rot, k_rot = apply_rotary_emb(q_rot, k_rot, freqs_cis)
        kv = self.wkv_b(kv_lat).view(bs, seqlen, self.n_heads, self.nope + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(bs, seqlen, self.n_heads, self.rope)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False, self.mask)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class LlamaFeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier, given=0):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        if given:
            hidden_dim = given
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked on a leading expert dim."""

    def __init__(self, n, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(n, hidden, dim))
        self.w2 = nn.Parameter(torch.zeros(n, dim, hidden))
        self.w3 = nn.Parameter(torch.zeros(n, hidden, dim))

    def expert(self, e, x):
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])


class LlamaMoE(nn.Module):
    """The mixture-of-experts feed-forward written the plain way: route, then a loop over the experts.

    With aux_loss_coeff, a training forward appends each sequence's load-balancing loss (summed over the
    batch) to self.aux, for the training loop to add to the loss (take_aux); with bias_update_rate, it
    counts the rows routed to each expert for update_bias() after the optimizer step; with
    capacity_factor, each expert keeps the first ceil(cf * S * k / n) of each sequence's tokens routed to it.
    With expert_bias (or bias_update_rate), the float32 buffer expert_bias is added to the scores for the
    choice only; with n_group > 1 (DeepSeek-V3), a token chooses among the experts of its topk_group best
    groups only (n_group equal contiguous groups, each scored by the sum of its top 2 biased scores).
    """

    def __init__(self, a, hidden):
        super().__init__()
        n = a["n_experts"]
        self.n, self.k = n, a.get("top_k", 1)
        self.sigmoid = a.get("score_func", "softmax") == "sigmoid"
        self.route_norm, self.route_scale = a.get("route_norm", False), a.get("route_scale", 1.0)
        self.aux_coeff = a.get("aux_loss_coeff", 0.0)
        self.z_coeff = a.get("z_loss_coeff", 0.0)
        self.bias_rate = a.get("bias_update_rate", 0.0)
        self.capacity_factor = a.get("capacity_factor", 0.0)
        self.aux = []
        self.grouped = False  # grouped_experts in place of the loop (gpu_peer.py --grouped-mm)
        self.counts = torch.zeros(n)
        if self.bias_rate > 0 or a.get("expert_bias", False):
            self.register_buffer("expert_bias", torch.zeros(n))
        self.n_group, self.topk_group = a.get("n_group", 1), a.get("topk_group", 1)
        hidden = a.get("moe_hidden_dim", 0) or hidden
        self.router = nn.Linear(a["dim"], n, bias=False)
        self.experts = Experts(n, a["dim"], hidden)
        shared = a.get("n_shared_experts", 0)
        self.shared = LlamaFeedForward(a["dim"], 0, 1, 0, given=hidden * shared) if shared else None

    def route(self, flat, with_scores=False):
        """Each token's top_k expert ids [tokens, k] and their weights (float32); with_scores: also every
        expert's score [tokens, n] (the load-balancing loss's)."""
        logits = self.router(flat).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        choose = scores + self.expert_bias if hasattr(self, "expert_bias") else scores
        if self.n_group > 1:  # DeepSeek-V3's group limit: the other groups' experts are out of the choice
            grouped = choose.view(-1, self.n_group, self.n // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            kept = torch.topk(group_scores, self.topk_group, dim=-1).indices
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(1, kept, False)
            choose = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, self.n)
        ids = torch.topk(choose, self.k, dim=-1, largest=True, sorted=True).indices
        training = torch.is_grad_enabled()
        if training:
            self.counts += torch.bincount(ids.reshape(-1), minlength=self.n).float()
        weights = scores.gather(-1, ids)
        if self.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return (ids, weights, scores) if with_scores else (ids, weights)

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        ids, weights, scores = self.route(flat, with_scores=True)
        training = torch.is_grad_enabled()
        out = torch.zeros_like(flat)
        b, s = x.shape[0], x.shape[1]
        capacity = math.ceil(self.capacity_factor * s * self.k / self.n) if self.capacity_factor > 0 else None
        grouped = self.grouped and capacity is None
        if grouped:
            out = self.grouped_experts(flat, ids, weights)
        for e in range(0 if grouped else self.n):
            token, choice = (ids == e).nonzero(as_tuple=True)
            if capacity is not None:  # each sequence's first `capacity` tokens routed to e
                keep = [i for i, t in enumerate(token.tolist())
                        if sum(1 for u in token.tolist()[:i] if u // s == t // s) < capacity]
                token, choice = token[keep], choice[keep]
            if token.numel() == 0:
                continue
            y = self.experts.expert(e, flat[token])
            out = out.index_add(0, token, (y.float() * weights[token, choice].unsqueeze(1)).to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.z_coeff > 0 and training:  # ST-MoE's router z-loss, each sequence's mean over its tokens
            lse = torch.logsumexp(self.router(flat).float(), dim=-1).view(b, s)
            self.aux.append((lse ** 2).mean(1).sum() * self.z_coeff)
        if self.aux_coeff > 0 and training:
            p = scores / scores.sum(-1, keepdim=True) if self.sigmoid else scores
            total = 0
            for q in range(b):  # sequence q: n * sum_i f_i P_i
                rows = slice(q * s, (q + 1) * s)
                f = torch.bincount(ids[rows].reshape(-1), minlength=self.n).float() / (s * self.k)
                total = total + self.n * (f * p[rows].mean(0)).sum()
            self.aux.append(total * self.aux_coeff)
        return out.view(x.shape)

    def grouped_experts(self, flat, ids, weights):
        """The routed experts as torchtitan runs them: the (token, choice) rows sorted by expert, and
        each projection one torch._grouped_mm over every expert's rows (its offsets the cumulative
        counts). gpu_peer.py's --grouped-mm; the loop above is the reference."""
        choice = ids.reshape(-1)
        order = torch.argsort(choice, stable=True)
        offs = torch.cumsum(torch.bincount(choice, minlength=self.n), 0, dtype=torch.int32)
        token = order // self.k
        rows = flat[token]
        w = self.experts
        h = F.silu(torch._grouped_mm(rows, w.w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
            rows, w.w3.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(h, w.w2.transpose(-2, -1), offs=offs)
        weighted = (y.float() * weights.reshape(-1)[order].unsqueeze(1)).to(flat.dtype)
        return torch.zeros_like(flat).index_add(0, token, weighted)

    def take_aux(self):
        aux, self.aux = self.aux, []
        return sum(aux) if aux else 0.0

    def update_bias(self):
        """Megatron's auxiliary-loss-free update: bias += rate * sign(mean(c) - c); then the counts restart."""
        if self.bias_rate > 0:
            with torch.no_grad():
                self.expert_bias += torch.sign(self.counts.mean() - self.counts) * self.bias_rate
        self.counts.zero_()


class LlamaBlock(nn.Module):
    def __init__(self, a, layer=0):
        super().__init__()
        self.attention = MLAttention(a) if a.get("kv_lora_rank", 0) > 0 else LlamaAttention(a)
        dense = LlamaFeedForward(a["dim"], 4 * a["dim"], a["multiple_of"], a["ffn_dim_multiplier"],
                                 a.get("hidden_dim", 0))
        # Routed: past the first n_dense_layers (DeepSeek-V3's first_k_dense_replace), every
        # moe_layer_step-th layer (Qwen3-MoE's decoder_sparse_step), but for those dense_layers lists
        # ("0, 2": Qwen3-MoE's mlp_only_layers).
        dense_layers = [int(i) for i in a.get("dense_layers", "").split(",") if i.strip()]
        if (a.get("n_experts", 0) and layer >= a.get("n_dense_layers", 0)
                and (layer + 1) % a.get("moe_layer_step", 1) == 0 and layer not in dense_layers):
            self.feed_forward = LlamaMoE(a, dense.w1.out_features)
        else:
            self.feed_forward = dense
        self.attention_norm = RMSNorm(a["dim"], a["norm_eps"])
        self.ffn_norm = RMSNorm(a["dim"], a["norm_eps"])

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, **a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a["vocab_size"], a["dim"])
        # The rotated part of a head: all of it, or multi-head latent attention's qk_rope_head_dim.
        rope_dim = a["qk_rope_head_dim"] if a.get("kv_lora_rank", 0) > 0 else (
            a.get("head_dim", 0) or a["dim"] // a["n_heads"])
        self.register_buffer("freqs_cis", precompute_freqs_cis(rope_dim, a["max_seq_len"] * 2, a["rope_theta"], a),
                             persistent=True)
        self.layers = nn.ModuleDict({str(i): LlamaBlock(a, i) for i in range(a["n_layers"])})
        self.norm = RMSNorm(a["dim"], a["norm_eps"])
        self.output = nn.Linear(a["dim"], a["vocab_size"], bias=False)
        if a.get("weight_tying"):
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        doc = getattr(self, "doc_start", None)
        seq = tokens.size(1)
        # Packed documents: each token's angles by its position in its document.
        freqs_cis = self.freqs_cis[0:seq] if doc is None else self.freqs_cis[torch.arange(seq) - doc]
        for layer in self.layers.values():
            layer.attention.mask = None if doc is None else document_mask(doc, True)
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


# ---- M15 / M10: composable and FSDP-core models -----------------------------

class UnitModule(nn.Module):
    def __init__(self, dim=100):
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim), nn.ReLU())
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.l2(self.seq(self.l1(x)))


class CompositeModel(nn.Module):
    def __init__(self, dim=100):
        super().__init__()
        self.l1 = nn.Linear(dim, dim)
        self.u1 = UnitModule(dim)
        self.u2 = UnitModule(dim)
        self.l2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.l2(self.u2(self.u1(self.l1(x))))


class CompositeParamModel(nn.Module):
    def __init__(self, dim=100):
        super().__init__()
        self.l = nn.Linear(dim, dim)
        self.u1 = UnitModule(dim)
        self.u2 = UnitModule(dim)
        self.p = nn.Parameter(torch.randn((dim, dim)))

    def forward(self, x):
        return torch.mm(self.u2(self.u1(self.l(x))), self.p)


class NestedWrappedModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Linear(16, 4), nn.Linear(4, 8))

    def forward(self, x):
        return self.module(x)


# ---- M9: the FSDP core tests' TransformerWithSharedParams -------------------

class TransformerWithSharedParams(nn.Module):
    """common_fsdp's TransformerWithSharedParams (add_bn=True), built on torch.nn.Transformer. Its forward
    takes composer's packed samples: each row is one (src, tgt) input of the seed's forward,
    src.view(-1) ++ tgt.view(-1) with src (src_len, bs) and tgt (tgt_len, bs) seq-first, and the seed's
    forward runs on each sample in turn; the output is (n, tgt_len, bs, vocab_size). mode "eval" keeps the
    seed's model.eval() through training."""

    def __init__(self, vocab_size=23, d_model=16, nhead=8, num_encoder_layers=2, num_decoder_layers=2,
                 dim_feedforward=8, dropout_p=0.1, src_len=6, tgt_len=4, bs=2, mode="eval"):
        super().__init__()
        self.src_len, self.tgt_len, self.bs, self.train_mode = src_len, tgt_len, bs, mode == "train"
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        with warnings.catch_warnings():  # the nested-tensor fast path needs batch_first; the seed is seq-first
            warnings.simplefilter("ignore")
            self.transformer = nn.Transformer(d_model=d_model, nhead=nhead, num_encoder_layers=num_encoder_layers,
                                              num_decoder_layers=num_decoder_layers,
                                              dim_feedforward=dim_feedforward, dropout=dropout_p)
        self.output_proj = nn.Linear(d_model, vocab_size)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", self.embed_tokens.weight.new_ones((d_model,)))
        self.register_buffer("long_buffer", torch.zeros_like(self.vocab_bias, dtype=torch.long))
        self.bn = nn.BatchNorm1d(bs)
        self.train()

    def train(self, mode=True):
        return super().train(mode and self.train_mode)

    def seed_forward(self, src_ids, tgt_ids):
        src = self.embed_tokens(src_ids)
        src = src + self.vocab_bias + self.long_buffer.type_as(src)
        tgt = self.embed_tokens(tgt_ids)
        tgt = self.bn(tgt)
        x = self.transformer(src, tgt)
        return self.output_proj(x)

    def forward(self, ids):
        split = self.src_len * self.bs
        return torch.stack([self.seed_forward(row[:split].view(self.src_len, self.bs),
                                              row[split:].view(self.tgt_len, self.bs)) for row in ids])


REGISTRY = {
    "mlp_module": MLPModule,
    "mlp_module_even": MLPModuleEven,
    "mlp_module_layers": MLPModuleLayers,
    "mlp": MLP,
    "mlp_stack": mlp_stack,
    "mlp_seq": mlp_seq,
    "simple_model": SimpleModel,
    "simple_model_uneven": SimpleModelUneven,
    "transformer": Transformer,
    "llama": Llama,
    "qwen3": Llama,  # llama's decoder with qk_norm on (model.args carries it)
    "deepseek_v3": Llama,  # llama's decoder with multi-head latent attention and group-limited routing
    "unit_module": UnitModule,
    "composite_model": CompositeModel,
    "composite_param_model": CompositeParamModel,
    "nested_wrapped_module": NestedWrappedModule,
    "transformer_with_shared_params": TransformerWithSharedParams,
}


def build(name, args):
    return REGISTRY[name](**args)


class MixtureOfExperts(nn.Module):  # M13, as the seed builds it on `rank`
    def __init__(self, rank=0):
        super().__init__()
        torch.manual_seed(42 + rank)  # each rank its own expert
        expert = nn.Linear(23, 12)
        for p in expert.parameters():
            p.expert = True
        torch.manual_seed(0)  # every other parameter the same on every rank
        shared = nn.Linear(12, 23)
        self.module = nn.Sequential(nn.Linear(8, 12), shared, expert, nn.Linear(12, 8))

    def forward(self, x):
        return self.module(x)


REGISTRY["mixture_of_experts"] = MixtureOfExperts

"""train.fp8 written the plain way: each selected nn.Linear quantises its input and weight to float8
e4m3, and in backward its output gradient to e5m2, each with one scale per tensor (the format's largest
finite value over the tensor's largest magnitude), then multiplies the dequantised values in the
training dtype. composer's float8 matmul (at::_scaled_mm) multiplies the float8 values and scales the
sum; both sums are of the same exact products, so they differ only in summation order."""
import re

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def dequantised(t, f8):
    """t rounded to f8 with a tensorwise scale, back in t's dtype (float32 arithmetic as composer's)."""
    t = t.detach()
    amax = t.abs().max().float()
    scale = amax.clamp(min=1e-12).reciprocal() * torch.finfo(f8).max
    q = (t.float() * scale).to(f8)
    return (q.float() * scale.reciprocal()).to(t.dtype)


class Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        x2 = x.reshape(-1, x.shape[-1])
        xq, wq = dequantised(x2, E4M3), dequantised(w, E4M3)
        ctx.save_for_backward(xq, wq)
        ctx.x_shape, ctx.has_bias = x.shape, b is not None
        y = xq @ wq.t()
        if b is not None:
            y = y + b
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        xq, wq = ctx.saved_tensors
        g2 = g.reshape(-1, wq.shape[0])
        gq = dequantised(g2, E5M2)
        gx = (gq @ wq).reshape(ctx.x_shape)
        gw = gq.t() @ xq
        gb = g2.sum(0) if ctx.has_bias else None
        return gx, gw, gb


def _pattern(p):
    """composer's FQN pattern (models/select.h): '*' within one dotted segment, '**' across segments."""
    out = ""
    for part in re.split(r"(\*\*|\*)", p):
        out += ".*" if part == "**" else "[^.]*" if part == "*" else re.escape(part)
    return re.compile(out + r"\Z")


def convert(model, modules):
    """Makes the nn.Linear layers inside the modules the patterns select compute in float8; returns how many."""
    patterns = [_pattern(p) for p in modules]
    selected = [n for n, _ in model.named_modules() if n and any(p.match(n) for p in patterns)]
    count = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == s or name.startswith(s + ".") for s in selected):
            m.forward = (lambda mod: lambda x: Float8Linear.apply(x, mod.weight, mod.bias))(m)
            count += 1
    return count

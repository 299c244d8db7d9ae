"""Test helper: the Weaver linear layer (``vllm_tfm.kernels.weaver_linear``'s function) in float64
from the stored values, with the size its float32 rounding errors scale with; for the CPU
emulation tests and the GPU tests."""

from __future__ import annotations

import torch


def float64_layer(x, w, b, res, eps, swiglu):
    """(exact output, error scale) in float64 from the stored values."""
    xd, wd = x.double(), w.double()
    s = 1.0 / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) if eps is not None else torch.ones_like(xd[:, :1])
    z = s * (xd @ wd.T)
    scale = s * (xd.abs() @ wd.abs().T)
    if b is not None:
        z, scale = z + b.double(), scale + b.double().abs()
    if swiglu:
        n = w.shape[0] // 2
        g, u = z[:, :n], z[:, n:]
        out = g * torch.sigmoid(g) * u
        return out, scale[:, :n] * u.abs() + scale[:, n:] * (g * torch.sigmoid(g)).abs() + out.abs()
    if res is not None:
        z, scale = z + res.double(), scale + res.double().abs()
    return z, scale

"""Injectable randomness for the tree verifiers: uniforms in [0, 1) and inverse-CDF draws.

Every stochastic decision of a verifier reads one uniform u from an explicit [R, W] float tensor
(layout documented by each verifier) and decides by an inverse CDF: outcome k iff
``c_{k-1} <= u < c_k`` for the cumulative weights c. The outcome is therefore piecewise constant
in each uniform, which is what lets tests integrate over the uniforms exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["Generators", "draw_uniforms", "check_uniforms", "inverse_cdf"]

Generators = torch.Generator | Mapping[int, torch.Generator] | None
"""One generator for the whole batch, per-request generators (vLLM's seeded requests: request
index -> generator; the other rows use the default generator), or None (default generator)."""


def draw_uniforms(num_requests: int, width: int, device: torch.device | str, generator: Generators = None) -> Tensor:
    """[num_requests, width] float64 uniforms in [0, 1) on ``device``."""
    if isinstance(generator, Mapping):
        u = torch.rand(num_requests, width, dtype=torch.float64, device=device)
        for r, g in generator.items():
            u[r] = torch.rand(width, dtype=torch.float64, device=device, generator=g)
        return u
    return torch.rand(num_requests, width, dtype=torch.float64, device=device, generator=generator)


def check_uniforms(uniforms: Tensor, num_requests: int, width: int, what: str) -> Tensor:
    """Validate caller-supplied uniforms ([R, width], float, in [0, 1)); return them as float64."""
    if uniforms.dim() != 2 or tuple(uniforms.shape) != (num_requests, width):
        raise ValueError(f"{what} needs uniforms of shape [{num_requests}, {width}], got {tuple(uniforms.shape)}")
    if not uniforms.dtype.is_floating_point:
        raise ValueError(f"uniforms must be a float tensor, got {uniforms.dtype}")
    if bool(((uniforms < 0) | (uniforms >= 1)).any()):
        raise ValueError("uniforms must lie in [0, 1)")
    return uniforms.to(torch.float64)


def inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Row-wise inverse CDF: the first index k with ``u * sum(w) < cumsum(w)_k``.

    weights: [R, K] non-negative (need not be normalised); u: [R] in [0, 1). Math in float64.
    A zero-weight entry is never chosen; if rounding pushes u past the total, the last entry with
    positive weight is returned (index 0 for an all-zero row). Returns [R] int64.
    """
    f64 = torch.float64
    w = weights if weights.dtype == f64 else weights.to(f64)
    cum = w.cumsum(dim=1)
    k = (cum <= ((u if u.dtype == f64 else u.to(f64)) * cum[:, -1]).unsqueeze(1)).sum(dim=1)
    last_positive = (w > 0).cumsum(dim=1).argmax(dim=1)  # the first index where the count of positives peaks
    return torch.where(k >= w.shape[1], last_positive, k)

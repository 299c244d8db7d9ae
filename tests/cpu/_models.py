"""Model helpers shared by the CPU tests."""

from __future__ import annotations

import torch


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """Random float64 weights everywhere (norm weights around 1): decisive, tie-free scores."""
    g = torch.Generator().manual_seed(seed)
    module.double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64) * scale
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return module


class Recorder:
    """Wraps a tree scorer and records every call's inputs and output (copies)."""

    def __init__(self, scorer):
        self.scorer, self.calls = scorer, []

    def __call__(self, *args):
        out = self.scorer(*args)
        self.calls.append(([a.clone() for a in args], out.clone()))
        return out

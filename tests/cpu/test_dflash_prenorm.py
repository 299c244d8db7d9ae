"""The DFlash drafter's pre-norm stream for TreeFlash (vllm_plugin/runtime/dflash_prenorm.py).

vLLM's DFlash forward ends in ``hidden, _ = self.norm(hidden, residual)``; after the final norm
is replaced, the drafter's output rows must carry [norm(hidden + residual) | hidden + residual]
and split back into both exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm_tfm.vllm_plugin.runtime.dflash_prenorm import PrenormOutputNorm, install_prenorm_output, split_rows


class FusedAddNorm(nn.Module):
    """vLLM's RMSNorm contract: (x) -> norm(x); (x, residual) -> (norm(x + residual), x + residual)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width, dtype=torch.float64))

    def forward(self, x, residual=None):
        s = x if residual is None else x + residual
        normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return normed if residual is None else (normed, s)


def dflash_tail(model: SimpleNamespace, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The last line of vLLM 0.26's DFlashQwen3Model.forward."""
    out, _ = model.norm(hidden, residual) if residual is not None else (model.norm(hidden, None)[0], None)
    return out


def test_replaced_norm_returns_normed_and_prenorm_rows_that_split_exactly():
    h = 6
    original = FusedAddNorm(h)
    drafter = SimpleNamespace(model=SimpleNamespace(norm=original))
    assert install_prenorm_output(drafter) is original
    assert isinstance(drafter.model.norm, PrenormOutputNorm)
    assert install_prenorm_output(drafter) is original and drafter.model.norm.inner is original  # idempotent
    g = torch.Generator().manual_seed(0)
    hidden, residual = (torch.randn(5, h, generator=g, dtype=torch.float64) for _ in range(2))
    rows = dflash_tail(drafter.model, hidden, residual)
    assert rows.shape == (5, 2 * h)
    normed, prenorm = split_rows(rows[[1, 3, 4]], h)  # the sampled rows, as vLLM indexes them
    s = hidden + residual
    assert torch.equal(prenorm, s[[1, 3, 4]])
    assert torch.equal(normed, original(s[[1, 3, 4]]))
    # no residual (a drafter of zero layers): the input itself is the stream
    normed0, prenorm0 = split_rows(dflash_tail(drafter.model, hidden, None), h)
    assert torch.equal(prenorm0, hidden) and torch.equal(normed0, original(hidden))


def test_split_refuses_rows_without_the_prenorm_half():
    with pytest.raises(RuntimeError, match=r"rows of width 6, expected 2 x 6 .*final norm was not replaced"):
        split_rows(torch.zeros(3, 6), 6)
    with pytest.raises(ValueError, match=r"TreeFlash needs the DFlash model's final norm"):
        install_prenorm_output(SimpleNamespace(model=SimpleNamespace()))

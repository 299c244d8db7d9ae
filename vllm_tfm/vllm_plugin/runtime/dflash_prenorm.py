"""The DFlash drafter's pre-norm residual stream, which the TreeFlash approximator reads.

TreeFlash corrects the DFlash residual stream h of every depth *before* the drafter's final norm
(``vllm_tfm.models.treeflash``). vLLM 0.26's DFlash model (``DFlashQwen3Model.forward``,
model_executor/models/qwen3_dflash.py:614-633) computes it as the second output of its final
``RMSNorm(hidden, residual)`` (= hidden + residual) and drops it; that forward is compiled
(``support_torch_compile``) and replayed from CUDA graphs, so no Python side effect inside it can
hand the stream out. Instead the final norm module of the loaded drafter is replaced (before its
first forward, hence before compilation) by :class:`PrenormOutputNorm`, whose first output is
``[normed | prenorm]`` (width 2H): the drafter then returns [T, 2H] rows, vLLM's DFlash proposer
indexes the sampled rows out of them unchanged (``last_hidden_states[token_indices_to_sample]``,
v1/spec_decode/llm_base_proposer.py:605, and DFlash drafts in parallel, so nothing else reads
them), and ``TFMProposer._sample_draft_tokens`` splits them with :func:`split_rows`. Plain data
flow: the same in eager mode, compiled or under CUDA graphs. The engine's compile-cache hash
carries the difference (``config_patch``: ``|prenorm``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["PrenormOutputNorm", "install_prenorm_output", "split_rows"]


class PrenormOutputNorm(nn.Module):
    """Wraps a vLLM ``RMSNorm``: ``(x, residual) -> ([norm(x + residual) | x + residual], x + residual)``
    (``residual`` None: ``x`` is the stream). ``inner`` is the original norm (its weights)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if residual is None:
            prenorm = x
            normed = self.inner(x)
        else:
            normed, prenorm = self.inner(x, residual)
        return torch.cat([normed, prenorm], dim=-1), prenorm


def install_prenorm_output(drafter: nn.Module) -> nn.Module:
    """Replace ``drafter.model.norm`` (vLLM's DFlash model) by :class:`PrenormOutputNorm`; returns
    the original norm (the TreeFlash scorer's ``final_norm``). Idempotent."""
    inner = getattr(drafter, "model", None)
    norm = getattr(inner, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(
            f"vllm-tfm: TreeFlash needs the DFlash model's final norm (drafter.model.norm); {type(drafter).__name__} has none"
        )
    if isinstance(norm, PrenormOutputNorm):
        return norm.inner
    inner.norm = PrenormOutputNorm(norm)
    return norm


def split_rows(rows: Tensor, hidden_size: int) -> tuple[Tensor, Tensor]:
    """[N, 2H] drafter output rows -> (normed [N, H], prenorm [N, H])."""
    if rows.shape[-1] != 2 * hidden_size:
        raise RuntimeError(
            f"vllm-tfm: the DFlash forward returned rows of width {rows.shape[-1]}, expected 2 x {hidden_size} "
            "(normed and pre-norm stream): the drafter's final norm was not replaced before it was compiled"
        )
    return rows[..., :hidden_size], rows[..., hidden_size:]

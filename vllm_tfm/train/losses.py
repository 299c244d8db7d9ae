"""Losses of the zoo trainers. All reductions in float32 (float64 for float64 inputs).

* :func:`forward_kl` -- KL(p || q) per row over the full vocabulary, p = softmax(target logits):
  the distillation loss of DFlash (``loss = "kl"``) and of the TreeFlash approximator.
* :func:`pool_forward_kl` -- the Weaver loss: KL from the target distribution restricted to the K
  candidates of the pool to Weaver's distribution over the same K, scaled by the target mass the
  pool covers (see its docstring for why and how out-of-pool mass is handled).
* :func:`depth_weights` -- exp(-(d - 1) / gamma) for depths d = 1..D, the DFlash paper's
  position-decayed block loss weight (DFlash, arXiv 2602.06036, training section; the same form
  is SpecForge's ``loss_decay_gamma``): early depths matter most because a draft token counts
  only when every earlier one was accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_tfm.models.common import compute_dtype

__all__ = ["depth_weights", "forward_kl", "cross_entropy_rows", "pool_forward_kl", "weighted_mean"]


def depth_weights(depth: int, gamma: float | None, device: torch.device | str | None = None) -> Tensor:
    """[depth] float32 weights exp(-(d - 1) / gamma), d = 1..depth; all ones when gamma is None."""
    d = torch.arange(depth, dtype=torch.float32, device=device)
    if gamma is None:
        return torch.ones_like(d)
    if not gamma > 0:
        raise ValueError(f"depth decay gamma must be > 0 or null, got {gamma}")
    return torch.exp(-d / gamma)


def forward_kl(target_logits: Tensor, draft_logits: Tensor) -> Tensor:
    """KL(softmax(target) || softmax(draft)) over the last dim: [...] (float32 / float64).

    target_logits, draft_logits: [..., V], any floating dtypes. 0 * log 0 terms count as 0.
    """
    cd = compute_dtype(draft_logits.dtype)
    log_p = torch.log_softmax(target_logits.to(cd), dim=-1)
    log_q = torch.log_softmax(draft_logits.to(cd), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)


def cross_entropy_rows(draft_logits: Tensor, labels: Tensor) -> Tensor:
    """-log softmax(draft)[label] per row: draft_logits [..., V], labels [...] int64 -> [...]."""
    cd = compute_dtype(draft_logits.dtype)
    log_q = torch.log_softmax(draft_logits.to(cd), dim=-1)
    return -log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def pool_forward_kl(target_logp_pool: Tensor, draft_logp_pool: Tensor) -> tuple[Tensor, Tensor]:
    """Weaver's loss on a pool of K candidates.

    Args:
        target_logp_pool: [..., K] log p_target(c) of the K candidates, p_target over the FULL
            vocabulary (so the K values sum to the covered mass m <= 1).
        draft_logp_pool: [..., K] Weaver log-probabilities over the pool (sum to 1).
    Returns:
        (loss [...], coverage m [...]). ``loss = m * KL(p_hat || q)`` with p_hat = p / m the
        target restricted to the pool and renormalised.

    Out-of-pool mass (1 - m) is not a Weaver decision: Weaver only orders tokens the DFlash pool
    offers, and a tree can never contain a token outside it. So it contributes no gradient (q has
    no mass to move there), and each row is weighted by m, so a node whose pool misses most of the
    target mass (where re-ranking cannot buy acceptance) counts proportionally less. Equivalently
    ``loss = sum_c p_c (log p_hat_c - log q_c)``, the forward KL's cross-entropy part on the pool.
    """
    cd = compute_dtype(draft_logp_pool.dtype)
    t = target_logp_pool.to(cd)
    log_m = torch.logsumexp(t, dim=-1, keepdim=True)
    p_hat_log = t - log_m
    kl = F.kl_div(draft_logp_pool.to(cd), p_hat_log, log_target=True, reduction="none").sum(-1)
    m = log_m.squeeze(-1).exp()
    return m * kl, m


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    """sum(values * weights) / sum(weights) (weights broadcast; 0 when all weights are 0)."""
    w = torch.broadcast_to(weights.to(values.dtype), values.shape)
    return (values * w).sum() / w.sum().clamp_min(torch.finfo(values.dtype).tiny)

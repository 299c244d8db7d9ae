"""Inputs of the DFlash drafter after a tree step: context row order and the bonus rows.

After a tree-active step the root and the accepted path of a request are scattered among its
1 + B verified rows. The DFlash proposer (vLLM's ``DFlashProposer``) takes the first
``rows - num_rejected`` rows of each request as valid context, at the positions it is given, so
``dflash_context_order`` moves root + accepted path to the front (the drafter is then given the
sequential positions ``ctx + k`` of the rows, see proposer.py). ``bonus_rows`` finds the logits
row whose target hidden state produced each bonus token (the Weaver's prompt token 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dflash_context_order", "bonus_rows"]


def dflash_context_order(
    req_index: Tensor, row_base: Tensor, rows_per_req: Tensor, accepted_nodes: Tensor
) -> Tensor:
    """Permutation [T] of the step's rows: per request, rows before the root, the root, the
    accepted path in depth order, then the remaining rows in their order. No host sync.

    req_index: [T] request of each row; row_base: [R] row of each request's root (first logits
    row); rows_per_req: [R] scheduled rows; accepted_nodes: [R, Dmax] local node indices of the
    accepted path (-1 padding), node j being row ``row_base + j``.
    """
    t = req_index.shape[0]
    dev = req_index.device
    req = req_index.to(torch.long)
    base = row_base.to(torch.long)
    local = torch.arange(t, device=dev) - base[req]
    valid = accepted_nodes >= 0
    rank = torch.arange(1, accepted_nodes.shape[1] + 1, device=dev).expand_as(accepted_nodes)
    rows = torch.where(valid, base[:, None] + accepted_nodes, t)  # padding -> a spare slot
    path_rank = torch.zeros(t + 1, dtype=torch.long, device=dev)
    path_rank.scatter_(0, rows.reshape(-1), torch.where(valid, rank, 0).reshape(-1))
    path_rank = path_rank[:t]
    n = rows_per_req.to(torch.long)[req]
    key = torch.where(local <= 0, local, torch.where(path_rank > 0, path_rank, n + local))
    span = 4 * t + 4
    return torch.argsort(req * span + key + 2 * t + 2, stable=True)


def bonus_rows(sample_start: Tensor, last_node: Tensor) -> Tensor:
    """Logits row that produced each request's bonus token: [R] = sample_start + last accepted node."""
    return sample_start.to(torch.long) + last_node.to(torch.long)

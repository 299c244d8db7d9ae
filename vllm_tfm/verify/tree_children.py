"""Children of every node of a ragged tree batch, as padded tables (for vectorised tree walks)."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_tfm.tree.types import TreeBatch

__all__ = ["child_table", "first_occurrence"]


def child_table(trees: TreeBatch) -> Tensor:
    """[T, Cmax] int64: flat indices of each node's children in index order, -1 padding (Cmax >= 1)."""
    num_nodes = trees.num_nodes
    device = trees.tokens.device
    gparents = trees.global_parents()
    child = torch.nonzero(gparents >= 0).squeeze(1)
    parent = gparents[child]
    counts = torch.bincount(parent, minlength=num_nodes)
    cmax = max(int(counts.max()) if child.numel() else 0, 1)
    order = torch.argsort(parent, stable=True)  # children stay in index order within a parent
    parent, child = parent[order], child[order]
    slot = torch.arange(child.numel(), device=device) - (counts.cumsum(0) - counts)[parent]
    table = torch.full((num_nodes, cmax), -1, dtype=torch.long, device=device)
    table[parent, slot] = child
    return table


def first_occurrence(tokens: Tensor, valid: Tensor) -> Tensor:
    """[R, C] bool: valid slots whose token does not occur in an earlier valid slot of the row."""
    same = tokens.unsqueeze(2) == tokens.unsqueeze(1)  # [R, C, C]: slot j vs slot i
    earlier = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril(-1)
    dup = (same & earlier & valid.unsqueeze(1) & valid.unsqueeze(2)).any(dim=2)
    return valid & ~dup

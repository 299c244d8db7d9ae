"""Validation and indexing helpers for ragged tree batches, shared by the verify references.

A ragged batch holds the trees of R requests back to back: flat ``parents`` [T] (int64, local to
each request, -1 at each root) and ``cu_nodes`` [R+1] (int64 prefix sums of the node counts, like
vLLM's ``query_start_loc``). See ``vllm_tfm.tree.types`` for the conventions.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "request_bounds",
    "check_slot_indices",
    "check_per_request",
    "path_to_root",
    "local_ancestor_table",
]


def request_bounds(parents: Tensor, cu_nodes: Tensor, num_nodes: int) -> list[tuple[int, int]]:
    """Validate a ragged tree batch and return each request's (start, end) row range.

    parents: [T] int, local parent of every node (-1 at roots, else 0 <= parent < local index).
    cu_nodes: [R+1] int, cu_nodes[0] == 0, cu_nodes[-1] == T == num_nodes, every tree non-empty.
    Raises ValueError naming the first problem found.
    """
    if cu_nodes.dim() != 1 or cu_nodes.numel() < 2:
        raise ValueError(f"cu_nodes must be 1-D with R+1 >= 2 entries, got shape {tuple(cu_nodes.shape)}")
    if cu_nodes.dtype.is_floating_point or parents.dtype.is_floating_point:
        raise ValueError("parents and cu_nodes must be integer tensors")
    if parents.dim() != 1 or parents.numel() != num_nodes:
        raise ValueError(f"parents must have shape [{num_nodes}] (one per node), got {tuple(parents.shape)}")
    cu = [int(c) for c in cu_nodes.tolist()]
    if cu[0] != 0 or cu[-1] != num_nodes:
        raise ValueError(f"cu_nodes must start at 0 and end at the number of nodes {num_nodes}, got {cu[0]}..{cu[-1]}")
    counts = [e - s for s, e in zip(cu[:-1], cu[1:])]
    for r, c in enumerate(counts):
        if c <= 0:
            raise ValueError(f"request {r} has {c} nodes in cu_nodes; every tree needs at least its root")
    par = parents.to("cpu", torch.long)
    starts = torch.repeat_interleave(torch.tensor(cu[:-1], dtype=torch.long), torch.tensor(counts, dtype=torch.long))
    local = torch.arange(num_nodes, dtype=torch.long) - starts
    is_root = local == 0
    bad = (is_root & (par != -1)) | (~is_root & ((par < 0) | (par >= local)))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        r = int(torch.searchsorted(torch.tensor(cu), i, right=True)) - 1
        raise ValueError(
            f"parents[{i}] = {int(par[i])} is invalid for local node {int(local[i])} of request {r}: "
            "the root needs -1 and every other node 0 <= parent < its local index"
        )
    return list(zip(cu[:-1], cu[1:]))


def check_slot_indices(
    indices: Tensor, num_requests: int, num_slots: int, name: str, distinct: bool = False
) -> list[int]:
    """Validate a [R] tensor of state slots (each in [0, num_slots)); return it as a list."""
    if indices.dim() != 1 or indices.numel() != num_requests:
        raise ValueError(f"{name} must have shape [{num_requests}] (one per request), got {tuple(indices.shape)}")
    if indices.dtype.is_floating_point:
        raise ValueError(f"{name} must be an integer tensor, got {indices.dtype}")
    vals = [int(v) for v in indices.tolist()]
    for r, v in enumerate(vals):
        if not 0 <= v < num_slots:
            raise ValueError(f"{name}[{r}] = {v} is outside the {num_slots} state slots")
    if distinct and len(set(vals)) != len(vals):
        raise ValueError(f"{name} must be distinct: two requests would write the same state slot ({vals})")
    return vals


def check_per_request(values: Tensor | None, num_requests: int, name: str, default: int = 0) -> list[int]:
    """A [R] integer tensor (or None -> ``default`` everywhere) as a list of ints."""
    if values is None:
        return [default] * num_requests
    if values.dim() != 1 or values.numel() != num_requests:
        raise ValueError(f"{name} must have shape [{num_requests}] (one per request), got {tuple(values.shape)}")
    if values.dtype.is_floating_point:
        raise ValueError(f"{name} must be an integer tensor, got {values.dtype}")
    return [int(v) for v in values.tolist()]


def path_to_root(parents_local: list[int], node: int) -> list[int]:
    """Local indices of the root..node path, root first (parents_local[0] == -1)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents_local[node]
    return out[::-1]


def local_ancestor_table(parents_local: Tensor, width: int) -> Tensor:
    """[n, width] int64: column m holds the m-th ancestor of each node (column 0 = the node), -1 above the root."""
    n = parents_local.numel()
    par = parents_local.to(torch.long)
    table = torch.empty(n, max(width, 1), dtype=torch.long, device=par.device)
    table[:, 0] = torch.arange(n, device=par.device)
    for m in range(1, width):
        prev = table[:, m - 1]
        table[:, m] = torch.where(prev >= 0, par[prev.clamp(min=0)], prev)
    return table[:, :width]

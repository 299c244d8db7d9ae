"""Tree-step row layouts for the DFlash context-order tests (CPU emulation and GPU): requests with prefill rows
before their root, requests without drafts, random / chain / star / deep trees with a random accepted path, and
the expected order written out with Python lists."""

from __future__ import annotations

import torch
from torch import Tensor
from _trees import path_of, random_tree_parents

KINDS = ("random", "chain", "star", "deep")


def context_order_case(num_req: int, max_nodes: int, seed: int, device: str | torch.device = "cpu"
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[int]]:
    """(req_index, row_base, rows_per_req, accepted_nodes, expected perm) of ``num_req`` requests of 1 to
    ``max_nodes`` tree nodes each; a one-node request may have 1-3 rows before its root (a prompt chunk);
    ``accepted_nodes`` is [R, Dmax] with -1 padding (Dmax >= 1)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_nodes + 1, (num_req,), generator=gen).tolist()
    extra = [int(torch.randint(0, 4, (1,), generator=gen)) if s == 1 else 0 for s in sizes]
    rows_per_req = [s + e for s, e in zip(sizes, extra)]
    starts = [0]
    for n in rows_per_req:
        starts.append(starts[-1] + n)
    dmax = max(max(sizes) - 1, 1)
    accepted = torch.full((num_req, dmax), -1, dtype=torch.long)
    expected: list[int] = []
    for r, (n, e) in enumerate(zip(sizes, extra)):
        kind = KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))]
        parents = random_tree_parents(n, gen, kind)
        last = int(torch.randint(0, n, (1,), generator=gen))
        path = path_of(parents, last)[1:]
        accepted[r, : len(path)] = torch.tensor(path, dtype=torch.long)
        base = starts[r] + e
        rest = [j for j in range(1, n) if j not in path]
        expected += list(range(starts[r], base)) + [base] + [base + j for j in path] + [base + j for j in rest]
    req_index = torch.repeat_interleave(torch.arange(num_req), torch.tensor(rows_per_req))
    row_base = torch.tensor(starts[:-1]) + torch.tensor(extra)
    dev = torch.device(device)
    return (req_index.to(dev), row_base.to(dev), torch.tensor(rows_per_req).to(dev), accepted.to(dev), expected)

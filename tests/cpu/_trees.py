"""Random tree shapes for tests (parents in topological order, node 0 the root)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from vllm_tfm.vllm_plugin.runtime.state import ProposalStore

TREE_KINDS = ("random", "chain", "star", "deep")


def random_tree_parents(n: int, generator: torch.Generator, kind: str = "random") -> Tensor:
    """Parents [n] int64 of an n-node tree, parents[0] = -1 and 0 <= parents[i] < i.

    kind: "random" (each node's parent uniform over the earlier nodes: shallow, bushy),
    "chain" (i - 1), "star" (every node a child of the root), "deep" (parent i - 1 with
    probability 3/4, else one of the 4 previous nodes: a long spine with short side branches,
    depth about 0.8 n).
    """
    if n < 1:
        raise ValueError(f"a tree needs n >= 1 nodes, got {n}")
    if kind not in TREE_KINDS:
        raise ValueError(f"kind must be one of {TREE_KINDS}, got {kind!r}")
    parents = torch.full((n,), -1, dtype=torch.long)
    for i in range(1, n):
        if kind == "chain":
            parents[i] = i - 1
        elif kind == "star":
            parents[i] = 0
        elif kind == "random":
            parents[i] = int(torch.randint(0, i, (1,), generator=generator))
        else:
            if float(torch.rand((), generator=generator)) < 0.75:
                parents[i] = i - 1
            else:
                parents[i] = int(torch.randint(max(0, i - 4), i, (1,), generator=generator))
    return parents


def path_of(parents: Tensor, node: int) -> list[int]:
    """Local indices on the root..node path, root first (written independently of the package)."""
    out = []
    while node != -1:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


def ragged(parent_list: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Concatenate per-request parents into flat parents [T] and cu_nodes [R+1]."""
    cu = torch.zeros(len(parent_list) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([p.numel() for p in parent_list]).cumsum(0)
    return torch.cat(parent_list), cu


def proposal_store(proposals: dict[str, tuple[list[int], list[int]]]) -> ProposalStore:
    """A runtime ``ProposalStore`` holding ``{request id: (draft tokens, parents incl. the root's -1)}``."""
    from vllm_tfm.vllm_plugin.runtime.state import ProposalStore

    store = ProposalStore()
    ids = list(proposals)
    store.put(ids, torch.tensor([proposals[i][0] for i in ids]), torch.tensor([proposals[i][1] for i in ids]))
    return store

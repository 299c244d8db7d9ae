"""Token trees for tree speculative decoding, single and batched.

Conventions used everywhere in vllm_tfm (math, kernels, reference decoder, vLLM plugin):

* A request's tree has ``n = 1 + B`` nodes. Node 0 is the root: the last committed token (the
  "bonus" token of the previous step). Nodes 1..B are draft tokens.
* Nodes are in topological order: ``parents[i] < i`` for i >= 1 and ``parents[0] == -1``.
  Parent indices are *local* to the request.
* ``depth[i]`` is the number of edges from the root (root depth 0); the node's position in the
  sequence is ``prefix_len + depth[i]`` where prefix_len counts the committed tokens before the root.
* A batch is *ragged*: the trees of R requests are concatenated, ``cu_nodes`` ([R+1], int64)
  holds the prefix sums of the node counts, exactly like vLLM's ``query_start_loc``. Ragged is the
  layout vLLM hands to attention and GDN layers (the 1+B rows of each request are contiguous), so
  the same tensors flow from the tree builder to the verify kernels without re-padding.
* The ancestor relation is ancestor-or-self: ``M[i, j] = 1`` iff j lies on the root..i path.
  ``ancestor_bitmask`` packs row i of M into ``ceil(n / 64)`` int64 words (bit j of word j // 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Tree", "TreeBatch", "depths_from_parents", "ancestor_mask", "pack_bitmask"]


def _check_parents(parents: Tensor) -> None:
    if parents.dim() != 1 or parents.numel() == 0:
        raise ValueError(f"parents must be a non-empty 1-D tensor, got shape {tuple(parents.shape)}")
    if int(parents[0]) != -1:
        raise ValueError(f"node 0 must be the root (parent -1), got parent {int(parents[0])}")
    if parents.numel() > 1:
        idx = torch.arange(1, parents.numel(), device=parents.device)
        rest = parents[1:]
        bad = (rest < 0) | (rest >= idx)
        if bool(bad.any()):
            i = int(idx[bad][0])
            raise ValueError(
                f"parents must be in topological order (0 <= parents[i] < i): node {i} has parent {int(parents[i])}"
            )


def depths_from_parents(parents: Tensor) -> Tensor:
    """Depth of every node of one tree (root 0). O(n) on the CPU; parents must be topological."""
    par = parents.tolist()
    depth = [0] * len(par)
    for i in range(1, len(par)):
        depth[i] = depth[par[i]] + 1
    return torch.tensor(depth, dtype=torch.long, device=parents.device)


def ancestor_mask(parents: Tensor) -> Tensor:
    """Ancestor-or-self mask M ([n, n] bool): M[i, j] iff j is on the root..i path."""
    n = parents.numel()
    par = parents.tolist()
    m = torch.zeros(n, n, dtype=torch.bool)
    m[0, 0] = True
    for i in range(1, n):
        m[i] = m[par[i]]
        m[i, i] = True
    return m.to(parents.device)


def pack_bitmask(mask: Tensor) -> Tensor:
    """Pack a [n, n] bool mask into [n, ceil(n/64)] int64 words (bit j % 64 of word j // 64)."""
    n = mask.shape[-1]
    words = (n + 63) // 64
    padded = torch.zeros(*mask.shape[:-1], words * 64, dtype=torch.bool, device=mask.device)
    padded[..., :n] = mask
    bits = padded.view(*mask.shape[:-1], words, 64).to(torch.int64)
    weights = torch.ones(64, dtype=torch.int64, device=mask.device) << torch.arange(64, device=mask.device)
    # bit 63 overflows into the sign bit, which is what we want for a two's-complement word
    return (bits * weights).sum(-1)


@dataclass(frozen=True)
class Tree:
    """One request's token tree. ``tokens[0]`` is the root (last committed token).

    ``scores`` (optional) are the builder's path scores (log-probabilities of the root..node
    path under the proposal, root 0.0); ``draft_logprobs`` (optional) are per-node log q(node |
    parent) under the proposal, which traversal verification needs.
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    scores: Tensor | None = None
    draft_logprobs: Tensor | None = None

    @staticmethod
    def from_parents(
        tokens: Tensor | list[int],
        parents: Tensor | list[int],
        scores: Tensor | None = None,
        draft_logprobs: Tensor | None = None,
    ) -> "Tree":
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
        _check_parents(parents)
        if tokens.shape != parents.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} differ in shape")
        for name, t in (("scores", scores), ("draft_logprobs", draft_logprobs)):
            if t is not None and tuple(t.shape) != tuple(tokens.shape):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(tokens.shape)} (one per node)")
        return Tree(tokens, parents, depths_from_parents(parents), scores, draft_logprobs)

    @staticmethod
    def chain(tokens: Tensor | list[int]) -> "Tree":
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        return Tree.from_parents(tokens, torch.arange(-1, tokens.numel() - 1, device=tokens.device))

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def ancestor_mask(self) -> Tensor:
        return ancestor_mask(self.parents)

    def ancestor_bitmask(self) -> Tensor:
        return pack_bitmask(self.ancestor_mask())

    def path(self, node: int) -> list[int]:
        """Node indices on the root..node path, root first."""
        out = []
        par = self.parents.tolist()
        while node >= 0:
            out.append(node)
            node = par[node]
        return out[::-1]

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]

    def to(self, device: torch.device | str) -> "Tree":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Tree(self.tokens.to(device), self.parents.to(device), self.depth.to(device),
                    mv(self.scores), mv(self.draft_logprobs))


@dataclass(frozen=True)
class TreeBatch:
    """Ragged batch of trees (see module docstring). All tensors are flat over T total nodes."""

    tokens: Tensor  # [T] int64
    parents: Tensor  # [T] int64, local to the request, -1 at each root
    depth: Tensor  # [T] int64
    cu_nodes: Tensor  # [R+1] int64
    draft_logprobs: Tensor | None = None  # [T] float, log q(node | parent), 0 at roots
    scores: Tensor | None = None  # [T] float, builder path log-probabilities, 0 at roots

    @staticmethod
    def from_trees(trees: list[Tree]) -> "TreeBatch":
        """Concatenate trees; ``draft_logprobs`` / ``scores`` are kept only if every tree has them."""
        if not trees:
            raise ValueError("a TreeBatch needs at least one tree")
        counts = torch.tensor([t.num_nodes for t in trees], dtype=torch.long)
        cu = torch.zeros(len(trees) + 1, dtype=torch.long)
        cu[1:] = counts.cumsum(0)
        dev = trees[0].tokens.device
        dl = None
        if all(t.draft_logprobs is not None for t in trees):
            dl = torch.cat([t.draft_logprobs.to(dev) for t in trees])
        sc = None
        if all(t.scores is not None for t in trees):
            sc = torch.cat([t.scores.to(dev) for t in trees])
        return TreeBatch(
            torch.cat([t.tokens.to(dev) for t in trees]),
            torch.cat([t.parents.to(dev) for t in trees]),
            torch.cat([t.depth.to(dev) for t in trees]),
            cu.to(dev),
            dl,
            sc,
        )

    @property
    def num_requests(self) -> int:
        return int(self.cu_nodes.numel() - 1)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def tree(self, r: int) -> Tree:
        s, e = int(self.cu_nodes[r]), int(self.cu_nodes[r + 1])
        dl = None if self.draft_logprobs is None else self.draft_logprobs[s:e]
        sc = None if self.scores is None else self.scores[s:e]
        return Tree(self.tokens[s:e], self.parents[s:e], self.depth[s:e], sc, dl)

    def trees(self) -> list[Tree]:
        return [self.tree(r) for r in range(self.num_requests)]

    def global_parents(self) -> Tensor:
        """Parent indices into the flat [T] arrays (-1 at roots)."""
        starts = torch.repeat_interleave(self.cu_nodes[:-1], self.cu_nodes.diff())
        return torch.where(self.parents >= 0, self.parents + starts, self.parents)

    def request_index(self) -> Tensor:
        """[T] request id of every node."""
        r = torch.arange(self.num_requests, device=self.cu_nodes.device)
        return torch.repeat_interleave(r, self.cu_nodes.diff())

    def to(self, device: torch.device | str) -> "TreeBatch":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TreeBatch(self.tokens.to(device), self.parents.to(device), self.depth.to(device),
                         self.cu_nodes.to(device), mv(self.draft_logprobs), mv(self.scores))

"""Padded per-request tree state for the lockstep (batched) builders, and their sort keys.

``PaddedTrees`` holds R trees of at most ``1 + B`` nodes as [R, 1 + B] tensors (node 0 the root,
nodes in the builder's creation order, columns past ``num_nodes[r]`` are padding: token 0,
parent -1, depth 0, scores 0). ``draft_layout`` turns it into the layout the vLLM runtime moves
around (tokens [R, B] without the root, parents [R, 1 + B], every request completed to B nodes).

Sort keys. The builders order nodes by ``(-path score, rank path)`` where the rank path (the ranks
of the choices on root..node) is compared lexicographically (``vllm_tfm.tree._common``). On the
device a rank path of at most ``max_depth`` ranks, each < ``c``, is packed into a few int64 words:
digit ``rank + 1`` (1..c; 0 = no digit, so a prefix sorts before its extensions), most significant
first, ``62 // c.bit_length()`` digits per word, bit 62 of word 0 left free for a "dead" flag that
sorts absent entries after every live one. Comparing the words in order compares the rank paths.
``sort_by_key`` is then one stable sort per word (least significant word first) followed by one
stable sort on the score: the key order, with no data-dependent host work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .types import Tree, TreeBatch

__all__ = ["PaddedTrees", "RankPathCode", "fill_to_budget", "per_request_tensor", "sort_by_key", "stable_topk"]

DEAD_BIT = 1 << 62


@dataclass(frozen=True)
class RankPathCode:
    """How rank paths of at most ``max_len`` ranks in ``0..num_ranks-1`` pack into int64 words."""

    num_ranks: int
    max_len: int

    @property
    def bits(self) -> int:
        return max(self.num_ranks, 1).bit_length()

    @property
    def digits_per_word(self) -> int:
        return 62 // self.bits

    @property
    def words(self) -> int:
        return max(1, -(-self.max_len // self.digits_per_word))

    def digit(self, position: Tensor, rank: Tensor) -> Tensor:
        """Words [..., W] holding only ``rank`` at digit ``position`` (0-based, < max_len)."""
        dpw, bits = self.digits_per_word, self.bits
        word = position // dpw
        shift = bits * (dpw - 1 - position % dpw)
        value = (rank + 1) << shift
        w = torch.arange(self.words, device=position.device)
        return torch.where(word[..., None] == w, value[..., None], torch.zeros_like(value)[..., None])


def per_request_tensor(values: list[int], device: torch.device) -> Tensor:
    """[R] int64 on ``device``; a fill (no host-to-device copy, so no stream sync) when all are equal."""
    if all(v == values[0] for v in values):
        return torch.full((len(values),), values[0], dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, device=device)


def sort_by_key(score: Tensor, words: Tensor, alive: Tensor, dead_in_words: bool = False) -> Tensor:
    """Per row, the entry order by (dead last, score descending, rank path ascending).

    score [R, N] float (ignored where not ``alive``), words [R, N, W] int64 (rank-path code),
    alive [R, N] bool; ``dead_in_words``: word 0 of every dead entry already has ``DEAD_BIT`` set.
    Returns the permutation [R, N] (int64): the first column is the smallest key. Entries with
    equal keys keep their index order (never happens for distinct rank paths).
    """
    nw = words.shape[2]
    perm: Tensor | None = None
    for wi in reversed(range(nw)):
        key = words[:, :, wi]
        if wi == 0 and not dead_in_words:
            key = key | torch.where(alive, 0, DEAD_BIT)
        if perm is None:
            perm = torch.sort(key, dim=1, stable=True).indices
        else:
            perm = perm.gather(1, torch.sort(key.gather(1, perm), dim=1, stable=True).indices)
    # dead entries score -inf; an alive entry of score -inf (a float64 path sum that overflowed)
    # still precedes them: the dead bit decided their order above and this sort is stable
    s = torch.where(alive, score, float("-inf")).gather(1, perm)
    return perm.gather(1, torch.sort(s, dim=1, descending=True, stable=True).indices)


def stable_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` best entries of the last dim, best first, ties to the lower index: (values, indices).

    Same order as a stable descending sort truncated to k (``vllm_tfm.tree._common.ranked_rows``),
    without sorting the whole row: float32 / float16 / bfloat16 values map to an order-preserving
    int32 (``-0.0`` and ``0.0`` equal), joined with the reversed index into one int64 key, so every
    key is distinct and ``topk`` has no ties to order. float64 rows and rows of at most 1024
    entries take the full stable sort (one operation).
    NaN-free input is assumed (the builders check it). ``k`` is clipped to the row length.
    """
    k = min(k, x.shape[-1])
    if x.dtype == torch.float64 or 4 * k >= x.shape[-1] or x.shape[-1] <= 1024:  # short rows: one sort
        vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        return vals[..., :k], idx[..., :k]
    bits = x.float().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # -0.0 and 0.0 both map to 0
    n = x.shape[-1]
    rev = (n - 1) - torch.arange(n, device=x.device)
    key = ordered * (1 << 32) + rev
    idx = (n - 1) - key.topk(k, dim=-1).values % (1 << 32)
    return x.gather(-1, idx), idx


def fill_to_budget(tokens: Tensor, parents: Tensor, num_nodes: Tensor, filler: Tensor) -> tuple[Tensor, Tensor]:
    """Complete trees of ``num_nodes`` [R] nodes (root included) to 1 + B nodes.

    The missing nodes hang as a chain under the last real node (a chain stays a chain), each
    carrying ``filler`` [R] (any token: verification is exact for any draft token).
    tokens [R, B], parents [R, 1 + B] -> same shapes.
    """
    n = parents.shape[1]
    col = torch.arange(n, device=parents.device)
    missing = col[None, :] >= num_nodes[:, None]
    parents = torch.where(missing, (col - 1)[None, :].expand_as(parents), parents)
    tok_missing = missing[:, 1:]
    tokens = torch.where(tok_missing, filler[:, None].to(tokens.dtype).expand_as(tokens), tokens)
    return tokens, parents


@dataclass(frozen=True)
class PaddedTrees:
    """R trees in padded [R, 1 + B] tensors (module docstring). All tensors on one device."""

    tokens: Tensor  # [R, 1 + B] int64, column 0 = root token
    parents: Tensor  # [R, 1 + B] int64, -1 at the root and in padding
    depth: Tensor  # [R, 1 + B] int64
    scores: Tensor  # [R, 1 + B] float, path log-probability under the proposal (root 0)
    draft_logprobs: Tensor  # [R, 1 + B] float, log q(node | parent) (root 0)
    num_nodes: Tensor  # [R] int64, nodes of each tree, root included

    @property
    def num_requests(self) -> int:
        return int(self.tokens.shape[0])

    def tree(self, r: int) -> Tree:
        """Request r's tree (host sync)."""
        n = int(self.num_nodes[r])
        return Tree(
            self.tokens[r, :n],
            self.parents[r, :n],
            self.depth[r, :n],
            self.scores[r, :n],
            self.draft_logprobs[r, :n],
        )

    def trees(self) -> list[Tree]:
        return [self.tree(r) for r in range(self.num_requests)]

    def to_tree_batch(self) -> TreeBatch:
        return TreeBatch.from_trees(self.trees())

    def draft_layout(self, filler: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [R, B] (draft nodes, node j + 1 in column j) and parents [R, 1 + B], every tree
        completed to B draft nodes by ``fill_to_budget`` with ``filler`` [R]."""
        return fill_to_budget(self.tokens[:, 1:], self.parents, self.num_nodes, filler)

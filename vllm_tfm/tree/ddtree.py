"""DDTree: best-first tree from per-depth marginals only.

Algorithm from DDTree (liranringel/ddtree): the drafter gives independent per-depth marginals
q_d(.); a node's path score is sum_d log q_d(token at depth d). Starting from the root's first
child, repeatedly pop the best candidate from a heap, materialise it, and push its next sibling
(next-ranked token at the same depth, same parent) and its first child (top-1 token at depth + 1).
Written from the published description; no code copied.

Claim (tested against brute force): because log-probabilities are <= 0, path scores never increase
along a path, and the popped nodes are exactly the B smallest keys ``(-score, rank path)`` over all
prefixes of length 1..max_depth with finite score, in that order. ``rank path`` is the tuple of the
tokens' ranks (stable descending sort of each depth's marginal: ties to the lower token id) from
depth 1 to the node; comparing it lexicographically breaks score ties (a shorter prefix, then a
better-ranked sibling, first). The set is ancestor-closed and maximises the sum of path
probabilities (expected accepted length under the proposal) among ancestor-closed sets of size B.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from torch import Tensor

from ._common import (
    batch_size,
    check_depth_rows,
    check_logprobs,
    check_positive_int,
    check_root_token,
    check_root_tokens,
    make_tree,
    out_dtype,
    per_request,
    ranked_rows,
)
from .types import Tree, TreeBatch

__all__ = ["build_ddtree", "build_ddtree_batch"]


def build_ddtree(root_token: int | Tensor, marginal_logprobs: Tensor, budget: int, max_depth: int) -> Tree:
    """DDTree best-first tree of at most ``budget`` draft nodes from per-depth marginals.

    Args:
        root_token: last committed token (node 0).
        marginal_logprobs: [D, V] float log-probabilities of depths 1..D (row d-1 = depth d),
            D >= max_depth; rows past max_depth are ignored. Entries of -inf are never drafted.
        budget: B >= 1, draft nodes wanted (fewer come back only if the candidate space
            sum_{d<=max_depth} V^d of finite-score prefixes is smaller).
        max_depth: >= 1.

    Returns a Tree in pop order (topological; see the module docstring for the order and ties),
    ``scores`` = path log-probability, ``draft_logprobs`` = q_d(token) of each node (root 0).
    """
    root = check_root_token(root_token)
    budget = check_positive_int(budget, "budget")
    max_depth = check_positive_int(max_depth, "max_depth")
    check_logprobs(marginal_logprobs, "marginal_logprobs", "[D, V]", 2)
    check_depth_rows(marginal_logprobs.shape[0], max_depth, "marginal_logprobs")

    # A chosen node of rank r has its r better-ranked siblings chosen before it, so ranks < B.
    ranks = ranked_rows(marginal_logprobs[:max_depth], budget)  # per depth: (tokens, values)

    tokens, parents, scores, dlps = [root], [-1], [0.0], [0.0]
    # heap entry: (-score, rank_path, parent node, depth, rank); rank_path is unique, so the
    # comparison never reaches the payload.
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []
    if ranks[0][0]:
        heap.append((-ranks[0][1][0], (0,), 0, 1, 0))
    while heap and len(tokens) - 1 < budget:
        neg_score, path, parent, depth, rank = heapq.heappop(heap)
        toks, vals = ranks[depth - 1]
        node = len(tokens)
        tokens.append(toks[rank])
        parents.append(parent)
        scores.append(-neg_score)
        dlps.append(vals[rank])
        if rank + 1 < len(toks):  # next sibling: same parent, next-ranked token at this depth
            heapq.heappush(heap, (-(scores[parent] + vals[rank + 1]), path[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < max_depth and ranks[depth][0]:  # first child: top-1 token of depth + 1
            heapq.heappush(heap, (-(scores[node] + ranks[depth][1][0]), path + (0,), node, depth + 1, 0))
    return make_tree(tokens, parents, scores, dlps, out_dtype(marginal_logprobs.dtype), marginal_logprobs.device)


def build_ddtree_batch(
    root_tokens: Tensor | Sequence[int],
    marginal_logprobs: Tensor,
    budget: int | Sequence[int],
    max_depth: int | Sequence[int],
) -> TreeBatch:
    """``build_ddtree`` for R requests: root_tokens [R], marginal_logprobs [R, D, V].

    ``budget`` / ``max_depth`` are one int for all requests or one per request. Reference
    implementation: a Python loop over requests.
    """
    r = batch_size(marginal_logprobs, "marginal_logprobs", "[R, D, V]", 3)
    roots = check_root_tokens(root_tokens, r)
    budgets = per_request(budget, r, "budget")
    depths = per_request(max_depth, r, "max_depth")
    return TreeBatch.from_trees(
        [build_ddtree(roots[i], marginal_logprobs[i], budgets[i], depths[i]) for i in range(r)]
    )

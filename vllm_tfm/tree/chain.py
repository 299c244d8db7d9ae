"""Chain "tree": the top-1 token of each depth's marginal (plain DFlash block drafting, no tree)."""

from __future__ import annotations

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

__all__ = ["build_chain", "build_chain_batch"]


def build_chain(root_token: int | Tensor, marginal_logprobs: Tensor, budget: int, max_depth: int) -> Tree:
    """Chain of the argmax token per depth: ``min(budget, max_depth)`` draft nodes.

    Args:
        root_token: last committed token (node 0).
        marginal_logprobs: [D, V] float log-probabilities q_d(.) of depths 1..D (row d-1 = depth d),
            D >= max_depth; rows past max_depth are ignored.
        budget: B >= 1, the number of draft nodes (root excluded).
        max_depth: >= 1.

    Returns a Tree whose node d is the argmax of row d-1 (ties: lowest token id), parent d-1;
    ``scores`` are cumulative sums, ``draft_logprobs`` the marginal log-prob of each node (root 0).
    The chain stops early at a depth whose best entry is -inf (nothing with probability > 0).
    """
    root = check_root_token(root_token)
    budget = check_positive_int(budget, "budget")
    max_depth = check_positive_int(max_depth, "max_depth")
    check_logprobs(marginal_logprobs, "marginal_logprobs", "[D, V]", 2)
    check_depth_rows(marginal_logprobs.shape[0], max_depth, "marginal_logprobs")

    tokens, parents, scores, dlps = [root], [-1], [0.0], [0.0]
    for d, (idx, val) in enumerate(ranked_rows(marginal_logprobs[: min(budget, max_depth)], 1)):
        if not idx:
            break
        tokens.append(idx[0])
        parents.append(d)
        scores.append(scores[-1] + val[0])
        dlps.append(val[0])
    return make_tree(tokens, parents, scores, dlps, out_dtype(marginal_logprobs.dtype), marginal_logprobs.device)


def build_chain_batch(
    root_tokens: Tensor | Sequence[int],
    marginal_logprobs: Tensor,
    budget: int | Sequence[int],
    max_depth: int | Sequence[int],
) -> TreeBatch:
    """``build_chain`` for R requests: root_tokens [R], marginal_logprobs [R, D, V].

    ``budget`` / ``max_depth`` are one int for all requests or one per request. Reference
    implementation: a Python loop over requests.
    """
    r = batch_size(marginal_logprobs, "marginal_logprobs", "[R, D, V]", 3)
    roots = check_root_tokens(root_tokens, r)
    budgets = per_request(budget, r, "budget")
    depths = per_request(max_depth, r, "max_depth")
    return TreeBatch.from_trees(
        [build_chain(roots[i], marginal_logprobs[i], budgets[i], depths[i]) for i in range(r)]
    )

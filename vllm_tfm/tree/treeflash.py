"""TreeFlash: two-stage tree from marginals plus previous-token-corrected transitions.

Algorithm from TreeFlash (ETH-DISCO/TreeFlash; DESIGN.md section 10), selection objective from
OPT-Tree (arXiv 2406.17276: choose the nodes of highest path probability). Written from the
published description; no code copied.

* Stage 1: S_d = the top-M tokens of the marginal q_d (d = 1..max_depth-1), stable descending order
  (ties: lower token id). They are the "previous token" candidates of depth d + 1.
* Stage 2: ``transition_scorer(d, prev_tokens [M']) -> [M', V]`` gives corrected log-probs of the
  token at depth d given the previous token. It is called exactly once per depth, d = 1..max_depth
  in increasing order: with ``[root_token]`` at d = 1 and with S_{d-1} (rank order) for d >= 2.
  Each previous token keeps its top-M transitions (stable order, -inf dropped).
* Restricted transition graph: the root's children are the kept transitions of row (1, root); a
  node at depth d < max_depth with token t has children only if t is in S_d, namely the kept
  transitions of row (d + 1, t); otherwise it is a leaf.
* Selection: best-first on cumulative path log-probability (pop the best candidate, push its next
  sibling and its first child), to at most B nodes.

Claim (tested against brute force over the restricted graph): the result is the B smallest keys
``(-path score, rank path)`` over all root paths of that graph, in that order, where the rank path
lists the ranks of the transitions taken (lexicographic order breaks score ties). As
log-probabilities are <= 0, this is the ancestor-closed set of size B with the largest total path
probability within the graph.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch
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

__all__ = ["TransitionScorer", "build_treeflash", "build_treeflash_batch"]

TransitionScorer = Callable[[int, Tensor], Tensor]
"""transition_scorer(depth d (1-based), prev_tokens [M'] int64) -> [M', V] log-probabilities at depth d."""


def build_treeflash(
    root_token: int | Tensor,
    marginal_logprobs: Tensor,
    transition_scorer: TransitionScorer,
    budget: int,
    max_depth: int,
    top_m: int = 16,
) -> Tree:
    """TreeFlash tree of at most ``budget`` draft nodes.

    Args:
        root_token: last committed token (node 0).
        marginal_logprobs: [D, V] float log-probabilities (uncorrected drafter marginals) of depths
            1..D, D >= max_depth; only rows 1..max_depth-1 are read (stage 1).
        transition_scorer: see the module docstring; returns [M', V] log-probabilities (<= 0, no
            NaN) with V equal to the marginals' vocabulary.
        budget: B >= 1. Fewer nodes come back only when the restricted graph is smaller.
        max_depth: >= 1.
        top_m: M >= 1, stage-1 candidates per depth and transitions kept per previous token
            (clipped to V).

    Returns a Tree in pop order: ``scores`` = cumulative corrected log-probability,
    ``draft_logprobs`` = the transition log-prob of each node given its parent (root 0).
    """
    root = check_root_token(root_token)
    budget = check_positive_int(budget, "budget")
    max_depth = check_positive_int(max_depth, "max_depth")
    top_m = check_positive_int(top_m, "top_m")
    check_logprobs(marginal_logprobs, "marginal_logprobs", "[D, V]", 2)
    check_depth_rows(marginal_logprobs.shape[0], max_depth, "marginal_logprobs")
    vocab = marginal_logprobs.shape[1]
    m = min(top_m, vocab)
    device = marginal_logprobs.device

    # stage 1: S_d for d = 1..max_depth-1, as token -> row index of the depth d+1 transition table
    stage1: list[list[int]] = []
    if max_depth > 1:
        stage1 = [toks for toks, _ in ranked_rows(marginal_logprobs[: max_depth - 1], m, drop_neg_inf=False)]
    stage1_index = [{t: j for j, t in enumerate(s)} for s in stage1]

    # stage 2: transitions[d-1][j] = (tokens, values) kept for previous token j at depth d
    transitions: list[list[tuple[list[int], list[float]]]] = []
    dtype = out_dtype(marginal_logprobs.dtype)
    for d in range(1, max_depth + 1):
        prev = [root] if d == 1 else stage1[d - 2]
        out = transition_scorer(d, torch.tensor(prev, dtype=torch.long, device=device))
        name = f"transition_scorer output at depth {d}"
        if not isinstance(out, Tensor) or tuple(out.shape) != (len(prev), vocab):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"{name} must have shape [{len(prev)}, {vocab}], got {got}")
        check_logprobs(out, name, f"[{len(prev)}, {vocab}]", 2)
        if d == 1:
            dtype = out_dtype(out.dtype)
        transitions.append(ranked_rows(out, m))

    tokens, parents, scores, dlps = [root], [-1], [0.0], [0.0]
    # heap entry: (-score, rank_path, parent node, depth, table row j, rank); rank_path unique.
    heap: list[tuple[float, tuple[int, ...], int, int, int, int]] = []

    def push_first_child(node: int, d: int, j: int) -> None:
        toks, vals = transitions[d - 1][j]
        if toks:
            heapq.heappush(heap, (-(scores[node] + vals[0]), path_of[node] + (0,), node, d, j, 0))

    path_of: list[tuple[int, ...]] = [()]
    push_first_child(0, 1, 0)
    while heap and len(tokens) - 1 < budget:
        neg_score, path, parent, d, j, rank = heapq.heappop(heap)
        toks, vals = transitions[d - 1][j]
        node = len(tokens)
        tokens.append(toks[rank])
        parents.append(parent)
        scores.append(-neg_score)
        dlps.append(vals[rank])
        path_of.append(path)
        if rank + 1 < len(toks):  # next sibling: same previous token, next-ranked transition
            heapq.heappush(heap, (-(scores[parent] + vals[rank + 1]), path[:-1] + (rank + 1,), parent, d, j, rank + 1))
        if d < max_depth:  # continue only through a stage-1 candidate of depth d
            nxt = stage1_index[d - 1].get(toks[rank])
            if nxt is not None:
                push_first_child(node, d + 1, nxt)
    return make_tree(tokens, parents, scores, dlps, dtype, device)


def build_treeflash_batch(
    root_tokens: Tensor | Sequence[int],
    marginal_logprobs: Tensor,
    transition_scorers: Sequence[TransitionScorer],
    budget: int | Sequence[int],
    max_depth: int | Sequence[int],
    top_m: int = 16,
) -> TreeBatch:
    """``build_treeflash`` for R requests: root_tokens [R], marginal_logprobs [R, D, V], one
    transition scorer per request.

    ``budget`` / ``max_depth`` are one int for all requests or one per request. Reference
    implementation: a Python loop over requests.
    """
    r = batch_size(marginal_logprobs, "marginal_logprobs", "[R, D, V]", 3)
    roots = check_root_tokens(root_tokens, r)
    if len(transition_scorers) != r:
        raise ValueError(f"transition_scorers has {len(transition_scorers)} entries for {r} requests")
    budgets = per_request(budget, r, "budget")
    depths = per_request(max_depth, r, "max_depth")
    return TreeBatch.from_trees(
        [
            build_treeflash(roots[i], marginal_logprobs[i], transition_scorers[i], budgets[i], depths[i], top_m)
            for i in range(r)
        ]
    )

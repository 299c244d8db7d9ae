"""Weaver tree growth: DySpec-style best-first expansion, w nodes per scorer call.

Tree growth of DySpec (arXiv 2410.11744: greedy expansion of the node with the highest path
probability) batched as in DESIGN.md section 10: every expanded node publishes its top
``children_per_node`` children into a frontier keyed by path log-probability; each step
materialises the best ``width`` frontier entries as new nodes (appended in topological order) and
expands all of them in ONE scorer call. Written from the published description; no code copied.

Scorer protocol (a Weaver keeps per-node K/V, so the order matters)::

    scorer(node_ids [n], parent_ids [n], tokens [n], depths [n]) -> logprobs [n, K]

* int64 tensors on ``candidates.device``; 1 <= n <= width (the root call has n = 1).
* call 1 is the root alone: node_ids [0], parent_ids [-1], tokens [root_token], depths [0];
* later calls pass the nodes materialised in one step that are shallower than ``max_depth``, in
  creation order (ascending node id), so a node's parent was always passed in an earlier call;
* row i holds log-probabilities over ``candidates[depths[i]]`` (the K candidates of depth
  depths[i] + 1), conditioned on node i's realised root..node path.

Cost: one scorer call for the root, then one per materialised batch except the last (which is not
expanded). When every step finds at least ``width`` frontier entries (e.g. ``children_per_node >=
width`` with K >= children_per_node, finite scores) and max_depth does not bind, a budget of B nodes
takes exactly ceil(B / width) calls; a short frontier means smaller batches and more calls (at most B).

Claim (tested against brute force): ranks are the stable descending order of a scorer row (ties: the
lower candidate column); a frontier entry's key is ``(-path score, rank path)`` (rank path = ranks
along root..node, compared lexicographically). With ``width = 1`` the result is exactly the B
smallest keys over all candidate-index paths in which every step takes one of the parent's top
``children_per_node`` ranks, in that order (path scores never increase along a path because
log-probabilities are <= 0). With ``children_per_node >= K`` that is the B highest-score nodes, the
ancestor-closed set of size B of maximum total path probability. With ``width > 1`` a node's
children cannot be chosen in the step that materialises the node, so the tree may differ from that
optimum; each step still takes the best ``width`` entries of the current frontier.
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

__all__ = ["DEFAULT_WEAVER_CALLS", "MAX_DEFAULT_WIDTH", "MAX_WEAVER_CALLS", "WeaverScorer", "build_weaver",
           "build_weaver_batch", "default_weaver_width"]

WeaverScorer = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""scorer(node_ids [n], parent_ids [n], tokens [n], depths [n]) -> [n, K] log-probabilities."""


DEFAULT_WEAVER_CALLS = 8  # a tree of B nodes aims at ceil(B / 8) nodes per Weaver call ...
MAX_DEFAULT_WIDTH = 4  # ... up to 4: wider calls cost acceptance (B = 32: MAL -7.7% at w = 8 against w = 4)
MAX_WEAVER_CALLS = 16  # ... but never more than 16 calls (the published ceil(B / 16))


def default_weaver_width(budget: int) -> int:
    """w = max(ceil(B / 16), min(4, ceil(B / 8))): 1 up to B = 8, 2 at B = 16, 4 from B = 25 to 64,
    ceil(B / 16) above.

    Every Weaver call streams the Weaver's weights once and runs ~20 kernels, so the tree build's
    time goes with the number of calls; wider calls grow the tree less carefully. On the H200 at
    the 27B shape, B = 32 with w = 4 instead of the published ceil(B / 16) = 2 built the tree in
    2.61 ms instead of 3.99 and decoded 10.5% faster at batch 1 for 1.3% fewer accepted tokens
    (``bench/results/e2e_27b_linear_kernel_w{2,4}.json``, bench/NOTES.md section 28)."""
    budget = check_positive_int(budget, "budget")
    return max(-(-budget // MAX_WEAVER_CALLS), min(MAX_DEFAULT_WIDTH, -(-budget // DEFAULT_WEAVER_CALLS)))


def _check_candidates(candidates: object, max_depth: int) -> Tensor:
    if not isinstance(candidates, Tensor) or candidates.dim() != 2:
        got = f"shape {tuple(candidates.shape)}" if isinstance(candidates, Tensor) else type(candidates).__name__
        raise ValueError(f"candidates must be an int64 tensor of shape [D, K], got {got}")
    if candidates.shape[1] == 0:
        raise ValueError(f"candidates must hold at least one token per depth, got shape {tuple(candidates.shape)}")
    if candidates.dtype != torch.long:
        raise ValueError(f"candidates must be int64 token ids, got dtype {candidates.dtype}")
    check_depth_rows(candidates.shape[0], max_depth, "candidates")
    rows = candidates[:max_depth].cpu()
    if bool((rows < 0).any()):
        raise ValueError("candidates must be token ids >= 0")
    srt = rows.sort(dim=1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
    if bool(dup.any()):
        d = int(dup.nonzero()[0, 0])
        raise ValueError(f"candidates of depth {d + 1} contain a repeated token id")
    return rows


def build_weaver(
    root_token: int | Tensor,
    candidates: Tensor,
    scorer: WeaverScorer,
    budget: int,
    max_depth: int,
    width: int,
    children_per_node: int = 8,
) -> Tree:
    """Grow a tree of at most ``budget`` draft nodes with batched best-first Weaver expansion.

    Args:
        root_token: last committed token (node 0).
        candidates: [D, K] int64, the K candidate tokens of depths 1..D (row d-1 = depth d, e.g.
            DFlash top-K), distinct within a row; D >= max_depth, rows past max_depth ignored.
        scorer: see the module docstring for the exact call protocol; its rows must be
            log-probabilities (<= 0, no NaN); -inf entries are never drafted.
        budget: B >= 1. Fewer nodes come back only when the frontier runs dry.
        max_depth: >= 1; nodes at max_depth are not expanded (never passed to the scorer).
        width: w >= 1, nodes materialised (and expanded together) per step.
        children_per_node: >= 1, children each expanded node publishes (clipped to K).

    Returns a Tree in creation order: ``scores`` = path log-probability, ``draft_logprobs`` =
    the scorer's log-prob of the node given its parent (root 0).
    """
    root = check_root_token(root_token)
    budget = check_positive_int(budget, "budget")
    max_depth = check_positive_int(max_depth, "max_depth")
    width = check_positive_int(width, "width")
    children_per_node = check_positive_int(children_per_node, "children_per_node")
    cand = _check_candidates(candidates, max_depth)
    k = cand.shape[1]
    cand_lists = cand.tolist()
    device = candidates.device

    tokens, parents, scores, dlps = [root], [-1], [0.0], [0.0]
    depth = [0]
    rank_path: list[tuple[int, ...]] = [()]
    # frontier entry: (-score, rank_path, parent node, candidate column, logq); rank_path unique.
    frontier: list[tuple[float, tuple[int, ...], int, int, float]] = []
    num_calls = 0
    dtype: torch.dtype | None = None

    def expand(nodes: list[int]) -> None:
        nonlocal num_calls, dtype
        num_calls += 1
        out = scorer(
            torch.tensor(nodes, dtype=torch.long, device=device),
            torch.tensor([parents[i] for i in nodes], dtype=torch.long, device=device),
            torch.tensor([tokens[i] for i in nodes], dtype=torch.long, device=device),
            torch.tensor([depth[i] for i in nodes], dtype=torch.long, device=device),
        )
        name = f"scorer output (call {num_calls}, {len(nodes)} nodes)"
        if not isinstance(out, Tensor) or tuple(out.shape) != (len(nodes), k):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"{name} must have shape [{len(nodes)}, {k}], got {got}")
        check_logprobs(out, name, f"[{len(nodes)}, {k}]", 2)
        if dtype is None:
            dtype = out_dtype(out.dtype)
        for (cols, vals), i in zip(ranked_rows(out, children_per_node), nodes):
            for r, (c, v) in enumerate(zip(cols, vals)):
                heapq.heappush(frontier, (-(scores[i] + v), rank_path[i] + (r,), i, c, v))

    expand([0])
    while frontier and len(tokens) - 1 < budget:
        batch = []
        for _ in range(min(width, budget - (len(tokens) - 1))):
            if not frontier:
                break
            neg_score, path, parent, col, logq = heapq.heappop(frontier)
            node = len(tokens)
            d = depth[parent] + 1
            tokens.append(cand_lists[d - 1][col])
            parents.append(parent)
            scores.append(-neg_score)
            dlps.append(logq)
            depth.append(d)
            rank_path.append(path)
            batch.append(node)
        if len(tokens) - 1 >= budget:
            break  # the final batch is not expanded
        to_expand = [i for i in batch if depth[i] < max_depth]
        if to_expand:
            expand(to_expand)
    return make_tree(tokens, parents, scores, dlps, dtype or torch.float32, device)


def build_weaver_batch(
    root_tokens: Tensor | Sequence[int],
    candidates: Tensor,
    scorers: Sequence[WeaverScorer],
    budget: int | Sequence[int],
    max_depth: int | Sequence[int],
    width: int | Sequence[int],
    children_per_node: int = 8,
) -> TreeBatch:
    """``build_weaver`` for R requests: root_tokens [R], candidates [R, D, K], one scorer each.

    ``budget`` / ``max_depth`` / ``width`` are one int for all requests or one per request.
    Reference implementation: a Python loop over requests, each with its own stateful scorer
    (a production build batches all requests' frontier nodes into one Weaver call per step).
    """
    r = batch_size(candidates, "candidates", "[R, D, K]", 3)
    roots = check_root_tokens(root_tokens, r)
    if len(scorers) != r:
        raise ValueError(f"scorers has {len(scorers)} entries for {r} requests")
    budgets = per_request(budget, r, "budget")
    depths = per_request(max_depth, r, "max_depth")
    widths = per_request(width, r, "width")
    return TreeBatch.from_trees(
        [
            build_weaver(roots[i], candidates[i], scorers[i], budgets[i], depths[i], widths[i], children_per_node)
            for i in range(r)
        ]
    )

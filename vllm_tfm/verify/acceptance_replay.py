"""Acceptance replay (benchmarks only): accept tree paths whose depth follows a recorded profile.

A speed benchmark at full model scale has to run with random (dummy) weights, whose drafts the
target never accepts. Replay keeps every cost of a decode step (the drafter, the tree build, the
target's tree verify forward, the real tree sampler, the commit) and replaces only the *outcome*
of verification: the number A of accepted drafts of each request is drawn from a recorded
distribution (``vllm_tfm.verify.acceptance_profile``), so that all arms of a benchmark see
comparable acceptance. The output tokens are then NOT the model's; the plugin allows replay only
behind an explicit benchmark flag (``vllm_tfm.vllm_plugin.benchmark_mode``).

Two pieces, both plain torch:

* :func:`replay_accept`: per request, A ~ pmf (inverse CDF of one uniform, so a fixed uniform grid
  gives the pmf exactly), then the accepted path is the prefix of depth ``min(A, tree depth)`` of
  the tree's *deepest path* (to its first deepest node in node order). Why that path: (1) it is
  the only path along which every drawn A up to the tree's depth can be realised, so the
  replayed distribution is the profile's whenever the tree is deep enough (draws deeper than the
  tree are clamped and counted); (2) with the spine-first marginals below it is the path of the
  drafter's top-1 token at every depth, the path a well-trained drafter's accepted paths follow
  most of the time; (3) the cost of the steps that depend on the outcome (KV compaction, GDN
  state and conv commit, the drafter's context reorder) depends on the accepted length, not on
  which branch it is. The bonus token is the target's argmax after the last accepted node.
* :func:`spine_first_logits`: with dummy weights the DFlash marginals are flat, and a best-first
  tree over flat marginals is a star of depth 1 (every depth-1 node outscores every depth-2
  node), so no drawn A > 1 could be realised. Replay therefore reshapes each depth's marginal:
  the drafter's own top ``ranks`` tokens get a geometric distribution over their rank with top-1
  probability ``top1``, every other token ``exp(floor)`` relative weight. With ``top1`` high
  enough (:func:`spine_is_first`) every budget-B best-first tree first grows the top-1 spine to
  the full drafted depth, then siblings by rank: trees as deep as the drafter allows, the deepest
  (most solver levels) a real drafter would give, so the verify cost is not understated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_tfm.tree.types import TreeBatch

from .accept_result import AcceptResult, accept_result_from_last_node
from .tree_tables import TreeTables

__all__ = [
    "DEFAULT_SPINE_TOP1",
    "DEFAULT_SPINE_RANKS",
    "ReplayOutcome",
    "pmf_cdf",
    "draw_accepted",
    "deepest_nodes",
    "replay_accept",
    "geometric_rank_ratio",
    "spine_first_logits",
    "spine_is_first",
]

DEFAULT_SPINE_TOP1 = 0.9
DEFAULT_SPINE_RANKS = 8
FLOOR_LOGIT = -30.0


@dataclass(frozen=True)
class ReplayOutcome:
    """result: the replayed AcceptResult; drawn: [R] int64, A drawn from the profile; clamped: [R]
    bool, the tree was shallower than the draw (the realised length is the tree's depth)."""

    result: AcceptResult
    drawn: Tensor
    clamped: Tensor


def pmf_cdf(pmf: Sequence[float], device: torch.device | str = "cpu") -> Tensor:
    """Cumulative sums of ``pmf`` in float64 with the last entry exactly 1 ([D + 1])."""
    if len(pmf) < 1 or any(p < 0 for p in pmf):
        raise ValueError(f"pmf must be non-empty and non-negative, got {list(pmf)}")
    total = math.fsum(pmf)
    if total <= 0:
        raise ValueError("pmf sums to 0")
    cdf = torch.tensor(list(pmf), dtype=torch.float64).div(total).cumsum(0)
    cdf[-1] = 1.0
    return cdf.to(device)


def draw_accepted(cdf: Tensor, uniforms: Tensor) -> Tensor:
    """A = the smallest k with u < cdf[k] (inverse CDF), for uniforms in [0, 1): [R] int64.

    P(A = k) = cdf[k] - cdf[k - 1] exactly for u uniform on [0, 1)."""
    k = torch.searchsorted(cdf, uniforms.to(cdf.dtype), right=True)
    return k.clamp(max=cdf.numel() - 1).to(torch.long)


def deepest_nodes(trees: TreeBatch) -> Tensor:
    """[R] flat index of each request's first node (lowest index) of maximal depth."""
    n = trees.num_nodes
    req = trees.request_index()
    idx = torch.arange(n, device=trees.depth.device)
    # larger key = deeper, then earlier: depth * (n + 1) + (n - index)
    key = trees.depth * (n + 1) + (n - idx)
    best = torch.full((trees.num_requests,), -1, dtype=torch.long, device=key.device)
    best = best.scatter_reduce(0, req, key, reduce="amax", include_self=True)
    return n - best.remainder(n + 1)


def replay_accept(
    trees: TreeBatch, logits: Tensor, uniforms: Tensor, cdf: Tensor, tables: TreeTables | None = None
) -> ReplayOutcome:
    """Replayed verification of a ragged batch (module docstring).

    logits: [T, V] the target's logits at every node (row i: the distribution after node i);
    uniforms: [R] in [0, 1); cdf: [D + 1] from :func:`pmf_cdf`; tables: the batch's
    ``TreeTables`` (built from ``trees`` when None): the accepted node is read off the deepest
    node's row of ``tables.paths`` (its ancestor at the accepted depth).
    """
    if logits.dim() != 2 or logits.shape[0] != trees.num_nodes:
        raise ValueError(f"logits must be [T={trees.num_nodes}, V], got {tuple(logits.shape)}")
    if uniforms.shape != (trees.num_requests,):
        raise ValueError(f"uniforms must be [R={trees.num_requests}], got {tuple(uniforms.shape)}")
    if tables is None:
        tables = TreeTables.of(trees)
    else:
        tables.check(trees)
    drawn = draw_accepted(cdf, uniforms.to(cdf.device)).to(trees.depth.device)
    deepest = tables.deepest
    tree_depth = trees.depth[deepest]
    cur = tables.paths[deepest, torch.minimum(drawn, tree_depth)]  # the ancestor at the accepted depth
    bonus = logits[cur].argmax(dim=-1).to(torch.long)
    return ReplayOutcome(accept_result_from_last_node(trees, cur, bonus, tables), drawn, drawn > tree_depth)


def geometric_rank_ratio(top1: float, ranks: int) -> float:
    """rho with (1 - rho) / (1 - rho^ranks) = top1: a geometric law over ``ranks`` ranks whose
    rank 0 has probability ``top1`` (bisection; needs 1 / ranks < top1 < 1)."""
    if ranks < 2:
        raise ValueError(f"ranks must be >= 2, got {ranks}")
    if not 1.0 / ranks < top1 < 1.0:
        raise ValueError(f"top1 must be in (1/{ranks}, 1), got {top1}")

    def first(rho: float) -> float:
        return (1.0 - rho) / (1.0 - rho**ranks)

    lo, hi = 0.0, 1.0  # first() decreases from 1 (rho -> 0) to 1 / ranks (rho -> 1)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if first(mid) > top1:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def spine_first_logits(
    logits: Tensor, top1: float = DEFAULT_SPINE_TOP1, ranks: int = DEFAULT_SPINE_RANKS, floor: float = FLOOR_LOGIT
) -> Tensor:
    """Spine-first marginals [R, D, V] in the dtype of ``logits`` (module docstring): rank r <
    ``ranks`` of each depth's own ordering gets logit r * log(rho), every other token ``floor``."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [R, D, V], got {tuple(logits.shape)}")
    m = min(ranks, logits.shape[-1])
    rho = geometric_rank_ratio(top1, ranks)
    top = logits.topk(m, dim=-1).indices
    values = torch.arange(m, device=logits.device, dtype=torch.float64) * math.log(rho)
    out = torch.full(logits.shape, floor, dtype=logits.dtype, device=logits.device)
    out.scatter_(-1, top, values.to(logits.dtype).expand(top.shape).contiguous())
    return out


def spine_is_first(top1: float, depth: int, ranks: int = DEFAULT_SPINE_RANKS, vocab: int = 248_320,
                   floor: float = FLOOR_LOGIT) -> bool:
    """True when a best-first tree over spine-first marginals completes the top-1 spine to
    ``depth`` before it takes any other node: the depth-``depth`` spine node's path log-probability
    beats the best non-spine node's (rank 1 at depth 1; with rho the rank ratio, deeper siblings
    only score lower)."""
    rho = geometric_rank_ratio(top1, ranks)
    weights = [rho**r for r in range(ranks)]
    z = math.fsum(weights) + (vocab - ranks) * math.exp(floor)
    log_top1 = math.log(weights[0] / z)
    log_rank1 = math.log(weights[1] / z)
    return depth * log_top1 > log_rank1

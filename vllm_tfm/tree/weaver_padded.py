"""Weaver (DySpec-w) tree growth for R requests in lockstep on the device.

The same trees as ``vllm_tfm.tree.build_weaver`` run once per request (same tokens, parents,
node order, scores, draft log-probabilities; tested against it), with all requests' state in
padded tensors and no per-request Python:

* nodes [R, 1 + B] (token, parent, depth, path score, log q, rank-path code) and a frontier of
  fixed slots [R, (1 + B) * c] (c = min(children_per_node, K)): slot ``j * c + r`` holds the
  rank-r child that node j published when it was expanded, with its path score, candidate column
  and rank-path code, and an alive flag (published, finite, not yet materialised);
* one round = one step of every request's reference loop: sort the frontier slots by
  ``(-path score, rank path)`` (``padded.sort_by_key``), materialise the first
  ``min(width, budget left, alive slots)`` of each request as new nodes, then ONE batched scorer
  call for the new nodes of every request that are shallower than max_depth (masked ``valid``;
  a request that reached its budget expands nothing), whose stable top-c rows become new slots;
* path scores are float64 sums ``score(parent) + log q`` like the reference's Python floats.

Rounds. With ``S = max_r ceil(B_r / w_r)`` the first S rounds run without any host sync (each
request needs at least ceil(B_r / w_r) steps to place B_r nodes; a request that is done just
masks out). After round S one host sync asks whether any request still has budget left and
frontier entries or nodes to expand; only a short frontier (``children_per_node`` or K small,
-inf scores, max_depth binding) needs more rounds, then one sync per extra round. Scorer calls:
one for the roots, then one per round up to S - 1 (+ one per extra round): ceil(B / w) calls for
B nodes when the frontier never runs short, exactly the reference's count. The reference skips a
call when no node of the step can be expanded; the lockstep loop still calls the scorer in the
first S - 1 rounds, with every row masked, rather than sync to find out.

Batched scorer protocol::

    scorer(node_ids [R, w], parent_ids [R, w], tokens [R, w], depths [R, w], valid [R, w]) -> [R, w, K]

* int64 tensors (``valid`` bool) on ``candidates.device``; only rows with ``valid`` True are
  nodes to score, other rows hold arbitrary in-range values (node ids <= 1 + max budget, depths
  <= max max_depth, tokens from ``candidates``) and their outputs are ignored;
* call 1: the roots, node_ids 0, parent_ids -1, tokens = root tokens, depths 0, all valid (w = 1);
* later calls: the nodes materialised in one round (w = min(max width, max budget) columns, valid
  ones in ascending node id order); a valid node's parent was always valid in an earlier call;
* row [r, i] holds log-probabilities over ``candidates[r, depths[r, i]]`` conditioned on node
  i's root..node path in request r. Valid rows must be <= 0 without NaN (checked at the first
  host sync, ValueError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ._common import (
    batch_size,
    check_depth_rows,
    check_positive_int,
    out_dtype,
    per_request,
)
from .padded import DEAD_BIT, PaddedTrees, RankPathCode, per_request_tensor, sort_by_key, stable_topk

__all__ = ["BatchedWeaverScorer", "build_weaver_padded", "root_token_tensor"]

BatchedWeaverScorer = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""scorer(node_ids, parent_ids, tokens, depths [R, w] int64, valid [R, w] bool) -> [R, w, K]."""

NEG_INF = float("-inf")


def root_token_tensor(root_tokens: Tensor | Sequence[int], num_requests: int, device: torch.device, check: bool) -> Tensor:
    """Root tokens as an int64 [R] tensor on ``device`` (checked >= 0 when ``check``: host sync)."""
    if isinstance(root_tokens, Tensor):
        if root_tokens.dim() != 1 or root_tokens.is_floating_point() or root_tokens.dtype == torch.bool:
            raise ValueError(
                f"root_tokens must be an integer tensor of shape [R], got {root_tokens.dtype} {tuple(root_tokens.shape)}"
            )
        roots = root_tokens.to(device=device, dtype=torch.long)
    else:
        roots = torch.tensor(list(root_tokens), dtype=torch.long, device=device)
    if roots.shape[0] != num_requests:
        raise ValueError(f"root_tokens has {roots.shape[0]} entries for {num_requests} requests")
    if check and bool((roots < 0).any()):
        raise ValueError(f"root tokens must be >= 0, got {roots.tolist()}")
    return roots


def _check_candidates(candidates: Tensor, depths: list[int]) -> None:
    """Token ids >= 0 and distinct within each depth row that request r reads (d < max_depth[r])."""
    if candidates.dtype != torch.long:
        raise ValueError(f"candidates must be int64 token ids, got dtype {candidates.dtype}")
    if candidates.shape[2] == 0:
        raise ValueError(f"candidates must hold at least one token per depth, got shape {tuple(candidates.shape)}")
    check_depth_rows(candidates.shape[1], max(depths), "candidates")
    rows = candidates[:, : max(depths)]
    read = torch.arange(rows.shape[1], device=rows.device)[None, :] < torch.tensor(depths, device=rows.device)[:, None]
    if bool(((rows < 0) & read[..., None]).any()):
        raise ValueError("candidates must be token ids >= 0")
    srt = rows.sort(dim=-1).values
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1) & read
    if bool(dup.any()):
        r, d = dup.nonzero()[0].tolist()
        raise ValueError(f"candidates of request {r}, depth {d + 1} contain a repeated token id")


def build_weaver_padded(
    root_tokens: Tensor | Sequence[int],
    candidates: Tensor,
    scorer: BatchedWeaverScorer,
    budget: int | Sequence[int],
    max_depth: int | Sequence[int],
    width: int | Sequence[int],
    children_per_node: int = 8,
    check: bool = True,
) -> PaddedTrees:
    """Weaver trees of R requests grown in lockstep (module docstring): ``build_weaver`` per request.

    Args:
        root_tokens: [R] last committed tokens (node 0 of each tree).
        candidates: [R, D, K] int64, row d - 1 = the K candidate tokens of depth d (distinct within
            a row); D >= max max_depth.
        scorer: batched scorer (module docstring), e.g. ``vllm_tfm.models.BatchedWeaverTreeScorer``.
        budget, max_depth, width: one int for all requests or one per request (all >= 1).
        children_per_node: children each expanded node publishes (clipped to K).
        check: validate root tokens and candidates (host syncs before the first round). Scorer
            outputs are always checked, at the first host sync of the loop.

    Returns a ``PaddedTrees`` of [R, 1 + max budget]; request r's first ``num_nodes[r]`` columns
    equal ``build_weaver(root_tokens[r], candidates[r], ..., budget[r], max_depth[r], width[r])``.
    """
    num_req = batch_size(candidates, "candidates", "[R, D, K]", 3)
    budgets = per_request(budget, num_req, "budget")
    depths = per_request(max_depth, num_req, "max_depth")
    widths = per_request(width, num_req, "width")
    cpn = check_positive_int(children_per_node, "children_per_node")
    dev = candidates.device
    if check:
        _check_candidates(candidates, depths)
    else:
        check_depth_rows(candidates.shape[1], max(depths), "candidates")
    roots = root_token_tensor(root_tokens, num_req, dev, check)

    r_, d_rows, k = candidates.shape
    c = min(cpn, k)
    bmax, dmax = max(budgets), max(depths)
    n_cap = 1 + bmax  # node columns; column n_cap is a write-only trash slot
    f_cap = n_cap * c  # frontier slots; slot f_cap is a write-only trash slot
    w = min(max(widths), bmax)
    code = RankPathCode(c, dmax)
    nw = code.words
    f64, i64 = torch.float64, torch.long
    budget_t = per_request_tensor(budgets, dev)
    depth_t = per_request_tensor(depths, dev)
    width_t = per_request_tensor(widths, dev)
    ar_w = torch.arange(w, device=dev)
    ar_c = torch.arange(c, device=dev)
    cand_flat = candidates.reshape(r_, d_rows * k)
    # digit[p, r]: the rank-path words of rank r at position p (a child of a node at depth p)
    pos = torch.arange(dmax, device=dev)
    digit = code.digit(pos[:, None].expand(dmax, c), ar_c.expand(dmax, c))  # [dmax, c, W]

    # Packed state (few tensors, so one gather / scatter moves a whole row):
    # nodes: ni [R, N+1, 3 + W] int64 = (token, parent, depth, rank-path words); nf [R, N+1, 2]
    # float64 = (path score, log q). Frontier slots: ei [R, F+1, 1 + W] int64 = (candidate column,
    # rank-path words with DEAD_BIT in word 0 unless alive); ef [R, F+1, 2] float64 = (score, log q).
    ni = torch.zeros(r_, n_cap + 1, 3 + nw, dtype=i64, device=dev)
    ni[:, :, 1] = -1
    ni[:, 0, 0] = roots
    nf = torch.zeros(r_, n_cap + 1, 2, dtype=f64, device=dev)
    ei = torch.zeros(r_, f_cap + 1, 1 + nw, dtype=i64, device=dev)
    ei[:, :, 1] = DEAD_BIT
    ef = torch.zeros(r_, f_cap + 1, 2, dtype=f64, device=dev)
    num_nodes = torch.ones(r_, dtype=i64, device=dev)
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    dtype: list[torch.dtype] = []
    calls = 0

    def push(out: Tensor, ids: Tensor, valid: Tensor) -> None:
        """Check a scorer output; the top-c children of every valid node become slots ids * c + rank."""
        nonlocal bad, calls
        calls += 1
        m = ids.shape[1]
        want = (r_, m, k)
        if not isinstance(out, Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"scorer output (call {calls}) must have shape [{want[0]}, {want[1]}, {want[2]}], got {got}")
        if not out.is_floating_point():
            raise ValueError(f"scorer output (call {calls}) must be floating log-probabilities, got dtype {out.dtype}")
        if not dtype:
            dtype.append(out_dtype(out.dtype))
        x = torch.where(valid[..., None], out, 0)
        bad = bad | (~(x <= 0)).any()  # NaN or positive in a valid row
        vals, cols = stable_topk(x, c)  # [R, m, c], best first
        vals = vals.to(f64)
        nid = torch.where(valid, ids, 0)
        node = ni.gather(1, nid[..., None].expand(r_, m, 3 + nw))  # the expanded nodes' rows
        alive = valid[..., None] & (vals > NEG_INF)
        words = node[:, :, None, 3:] + digit[node[..., 2].clamp(max=dmax - 1)]  # [R, m, c, W]
        words[..., 0] += torch.where(alive, 0, DEAD_BIT)
        slot = torch.where(valid[..., None], nid[..., None] * c + ar_c, f_cap).reshape(r_, m * c, 1)
        new_i = torch.cat([cols[..., None], words], dim=-1).reshape(r_, m * c, 1 + nw)
        pscore = nf[:, :, 0].gather(1, nid)
        new_f = torch.stack([pscore[..., None] + vals, vals], dim=-1).reshape(r_, m * c, 2)
        ei.scatter_(1, slot.expand(r_, m * c, 1 + nw), new_i)
        ef.scatter_(1, slot.expand(r_, m * c, 2), new_f)

    def materialise() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """One step of every request: new nodes and which of them to expand."""
        nonlocal num_nodes
        alive = ei[:, :, 1] < DEAD_BIT
        n_alive = alive.sum(1)
        take = torch.minimum(torch.minimum(width_t, budget_t - num_nodes + 1), n_alive)
        sel = sort_by_key(ef[:, :, 0], ei[:, :, 1:], alive, dead_in_words=True)[:, :w]  # best first
        ok = ar_w < take[:, None]
        got_i = ei.gather(1, sel[..., None].expand(r_, w, 1 + nw))
        got_f = ef.gather(1, sel[..., None].expand(r_, w, 2))
        parent = sel // c
        d = ni[:, :, 2].gather(1, parent) + 1
        tok = cand_flat.gather(1, (d - 1).clamp(0, d_rows - 1) * k + got_i[..., 0])
        node = torch.where(ok, num_nodes[:, None] + ar_w, n_cap)
        ni.scatter_(1, node[..., None].expand(r_, w, 3 + nw), torch.cat([torch.stack([tok, parent, d], -1), got_i[..., 1:]], -1))
        nf.scatter_(1, node[..., None].expand(r_, w, 2), got_f)
        ei[:, :, 1].scatter_(1, torch.where(ok, sel, f_cap), DEAD_BIT)
        num_nodes = num_nodes + take
        room = num_nodes <= budget_t
        expand = ok & (d < depth_t[:, None]) & room[:, None]
        more = room & ((n_alive > take) | expand.any(1))
        return node, parent, tok, d.clamp(max=dmax), expand, more

    zeros = torch.zeros(r_, 1, dtype=i64, device=dev)
    all_ok = torch.ones(r_, 1, dtype=torch.bool, device=dev)
    push(scorer(zeros, zeros - 1, roots[:, None], zeros, all_ok), zeros, all_ok)
    fixed_rounds = max(-(-b // wd) for b, wd in zip(budgets, widths))
    for rnd in range(1, 2 * bmax + 2):
        node, parent, tok, d, expand, more = materialise()
        if rnd >= fixed_rounds:
            more_any, is_bad = torch.stack([more.any(), bad]).tolist()
            if is_bad:
                raise ValueError("scorer output must be log-probabilities (<= 0, no NaN) in every valid row")
            if not more_any:
                break
        push(scorer(node, parent, tok, d, expand), node, expand)
    else:  # every round with work places a node or empties a frontier
        raise RuntimeError("Weaver growth did not finish: this is a bug")

    cols = slice(0, n_cap)
    dt = dtype[0]
    return PaddedTrees(
        ni[:, cols, 0], ni[:, cols, 1], ni[:, cols, 2], nf[:, cols, 0].to(dt), nf[:, cols, 1].to(dt), num_nodes
    )

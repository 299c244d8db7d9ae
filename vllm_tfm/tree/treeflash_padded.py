"""TreeFlash trees for R requests at once on the device, without a heap.

The same trees as ``vllm_tfm.tree.build_treeflash`` run once per request (tested against it).
That builder's best-first loop pops the B smallest keys ``(-path score, rank path)`` of the
restricted transition graph in key order (its module docstring). We get them depth by depth, like
the runtime's DDTree (``vllm_plugin.runtime.tree_builder_gpu.ddtree_trees``):

* Layer d keeps L = max budget nodes: the L best keys among the children of layer d - 1 (a
  node's children are the kept transitions of its row when its token is a stage-1 candidate of
  its depth, none otherwise). The global B best nodes of depth d are among them: their parents
  are among the global B best of depth d - 1 (a parent's key is smaller than its child's), which
  by induction lie in layer d - 1, and B best keys of a depth form a key-ordered prefix of any
  superset that contains them. Candidates are laid out parents-in-rank-path-order x transition
  rank, so the layout order IS the rank-path order and one stable sort on the score (then one on
  validity) gives the key order.
* The B_r smallest keys over all layers, via ``padded.sort_by_key``, are request r's tree, in
  the reference's pop order; parents are mapped to node indices.

Device calls: ``max(max_depth)`` transition-scorer calls (each for all R requests), a fixed number
of tensor operations per depth, and one host sync (the output check after the last scorer call;
more for the argument checks when ``check``).

Batched transition scorer protocol::

    transition_scorer(d, prev_tokens [R, M']) -> [R, M', V] log-probabilities at depth d

called once per depth d = 1..max(max_depth) in increasing order, with the root tokens [R, 1] at
d = 1 and the stage-1 tokens S_{d-1} [R, M] (rank order) for d >= 2. Rows of requests whose
max_depth is below d are ignored; the others must be <= 0 without NaN (checked, ValueError, at
one host sync after the last call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ._common import (
    batch_size,
    check_depth_rows,
    check_logprobs,
    check_positive_int,
    out_dtype,
    per_request,
)
from .padded import PaddedTrees, RankPathCode, per_request_tensor, sort_by_key, stable_topk
from .weaver_padded import root_token_tensor

__all__ = ["BatchedTransitionScorer", "build_treeflash_padded"]

BatchedTransitionScorer = Callable[[int, Tensor], Tensor]
"""transition_scorer(depth d (1-based), prev_tokens [R, M'] int64) -> [R, M', V] log-probabilities."""

NEG_INF = float("-inf")


def _key_order(score: Tensor, valid: Tensor) -> Tensor:
    """Stable order: valid first, then score descending; ties keep the layout (rank-path) order."""
    s = torch.where(valid, score, NEG_INF)
    perm = torch.sort(s, dim=1, descending=True, stable=True).indices
    return perm.gather(1, torch.sort((~valid).gather(1, perm).to(torch.int8), dim=1, stable=True).indices)


def build_treeflash_padded(
    root_tokens: Tensor | Sequence[int],
    marginal_logprobs: Tensor,
    transition_scorer: BatchedTransitionScorer,
    budget: int | Sequence[int],
    max_depth: int | Sequence[int],
    top_m: int = 16,
    check: bool = True,
) -> PaddedTrees:
    """TreeFlash trees of R requests (module docstring): ``build_treeflash`` per request.

    Args:
        root_tokens: [R] last committed tokens.
        marginal_logprobs: [R, D, V] drafter marginal log-probabilities, D >= max max_depth; rows
            1..max_depth-1 of each request give its stage-1 candidates.
        transition_scorer: batched scorer (module docstring), e.g.
            ``vllm_tfm.models.BatchedTreeFlashTransitionScorer``.
        budget, max_depth: one int for all requests or one per request (>= 1).
        top_m: M, stage-1 candidates per depth and transitions kept per previous token (clipped to V).
        check: validate root tokens and the marginals (host syncs). Scorer outputs are always checked.

    Returns a ``PaddedTrees`` of [R, 1 + max budget].
    """
    num_req = batch_size(marginal_logprobs, "marginal_logprobs", "[R, D, V]", 3)
    budgets = per_request(budget, num_req, "budget")
    depths = per_request(max_depth, num_req, "max_depth")
    top_m = check_positive_int(top_m, "top_m")
    dev = marginal_logprobs.device
    if check:
        check_logprobs(marginal_logprobs, "marginal_logprobs", "[R, D, V]", 3)
    check_depth_rows(marginal_logprobs.shape[1], max(depths), "marginal_logprobs")
    roots = root_token_tensor(root_tokens, num_req, dev, check)

    r_, _, vocab = marginal_logprobs.shape
    m = min(top_m, vocab)
    bmax, dmax = max(budgets), max(depths)
    lay = bmax  # nodes kept per depth
    f64, i64 = torch.float64, torch.long
    budget_t = per_request_tensor(budgets, dev)
    depth_t = per_request_tensor(depths, dev)
    code = RankPathCode(m, dmax)
    nw = code.words
    ar_m = torch.arange(m, device=dev)

    # stage 1: S_d (d = 1..dmax-1), rank order, -inf kept
    stage1 = stable_topk(marginal_logprobs[:, : dmax - 1], m)[1] if dmax > 1 else None  # [R, dmax-1, m]

    # stage 2: per depth, the kept transitions of every previous token (values float64, -inf = none)
    trans: list[tuple[Tensor, Tensor]] = []
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    dtype = out_dtype(marginal_logprobs.dtype)
    for d in range(1, dmax + 1):
        prev = roots[:, None] if d == 1 else stage1[:, d - 2]
        out = transition_scorer(d, prev)
        want = (r_, prev.shape[1], vocab)
        name = f"transition_scorer output at depth {d}"
        if not isinstance(out, Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"{name} must have shape [{want[0]}, {want[1]}, {want[2]}], got {got}")
        if not out.is_floating_point():
            raise ValueError(f"{name} must be floating log-probabilities, got dtype {out.dtype}")
        if d == 1:
            dtype = out_dtype(out.dtype)
        used = (d <= depth_t)[:, None, None]
        bad = bad | (((out > 0) | torch.isnan(out)) & used).any()
        vals, toks = stable_topk(torch.where(used, out, 0), m)  # [R, M', m]
        trans.append((vals.to(f64), toks))
    if bool(bad):  # the one host sync
        raise ValueError("transition_scorer output must be log-probabilities (<= 0, no NaN) in every row used")

    # layer 1: the root's kept transitions, already in key order (rank order)
    def pad(x: Tensor, fill: float | bool) -> Tensor:
        if x.shape[1] >= lay:
            return x[:, :lay]
        return torch.cat([x, x.new_full((r_, lay - x.shape[1], *x.shape[2:]), fill)], dim=1)

    v1, t1 = trans[0][0][:, 0], trans[0][1][:, 0]  # [R, m]
    score = pad(v1, NEG_INF)
    layers_score, layers_logq, layers_tok, layers_valid = [score], [score], [pad(t1, 0)], [pad(v1 > NEG_INF, False)]
    words0 = code.digit(torch.zeros(r_, m, dtype=i64, device=dev), ar_m.expand(r_, m))
    layers_words = [pad(words0, 0)]
    layers_parent = [torch.full((r_, lay), -1, dtype=i64, device=dev)]  # union index of the parent (-1 root)
    lexrank = torch.arange(lay, device=dev).expand(r_, lay)
    for d in range(2, dmax + 1):
        p_tok, p_score, p_valid, p_words = layers_tok[-1], layers_score[-1], layers_valid[-1], layers_words[-1]
        eq = p_tok[:, :, None] == stage1[:, d - 2, None, :]  # [R, L, m]: token is a stage-1 candidate
        row = eq.to(torch.int8).argmax(-1)
        p_valid = p_valid & eq.any(-1) & (d <= depth_t)[:, None]
        by_lex = torch.argsort(lexrank, dim=1)  # slot of the parent with rank-path rank i
        tv, tt = trans[d - 1]
        rows_lex = row.gather(1, by_lex)[..., None].expand(r_, lay, m)
        c_logq = tv.gather(1, rows_lex).reshape(r_, lay * m)
        c_tok = tt.gather(1, rows_lex).reshape(r_, lay * m)
        c_parent = by_lex[:, :, None].expand(r_, lay, m).reshape(r_, lay * m)
        c_rank = ar_m.repeat(lay).expand(r_, lay * m)
        c_score = p_score.gather(1, c_parent) + c_logq
        c_valid = p_valid.gather(1, c_parent) & (c_logq > NEG_INF)
        order = _key_order(c_score, c_valid)[:, :lay]
        parent = c_parent.gather(1, order)
        rank = c_rank.gather(1, order)
        layers_score.append(c_score.gather(1, order))
        layers_logq.append(c_logq.gather(1, order))
        layers_tok.append(c_tok.gather(1, order))
        layers_valid.append(c_valid.gather(1, order))
        layers_words.append(
            p_words.gather(1, parent[..., None].expand(r_, lay, nw))
            + code.digit(torch.full_like(rank, d - 1), rank)
        )
        layers_parent.append((d - 2) * lay + parent)
        lexrank = torch.argsort(torch.argsort(order, dim=1), dim=1)  # layout order is rank-path order

    u_score = torch.cat(layers_score, 1)
    u_valid = torch.cat(layers_valid, 1)
    chosen = sort_by_key(u_score, torch.cat(layers_words, 1), u_valid)[:, :bmax]  # union slots, pop order
    ar_b = torch.arange(bmax, device=dev)
    ok = u_valid.gather(1, chosen) & (ar_b < budget_t[:, None])
    num_nodes = 1 + ok.sum(1)
    node_of = torch.full_like(u_score, -1, dtype=i64)  # union slot -> node index
    node_of.scatter_(1, chosen, torch.where(ok, ar_b + 1, -1))
    u_parent = torch.cat(layers_parent, 1).gather(1, chosen)
    par = torch.where(u_parent >= 0, node_of.gather(1, u_parent.clamp(min=0)), 0)
    u_depth = (torch.arange(u_score.shape[1], device=dev) // lay + 1).expand(r_, -1).gather(1, chosen)

    def tree_cols(x: Tensor, root: float, fill: float) -> Tensor:
        body = torch.where(ok, x, fill)
        return torch.cat([body.new_full((r_, 1), root), body], dim=1)

    tokens = tree_cols(torch.cat(layers_tok, 1).gather(1, chosen), 0, 0)
    tokens[:, 0] = roots
    return PaddedTrees(
        tokens,
        tree_cols(par, -1, -1),
        tree_cols(u_depth, 0, 0),
        tree_cols(u_score.gather(1, chosen), 0.0, 0.0).to(dtype),
        tree_cols(torch.cat(layers_logq, 1).gather(1, chosen), 0.0, 0.0).to(dtype),
        num_nodes,
    )

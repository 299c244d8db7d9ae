"""Accepting a token tree without changing the target's output distribution (DESIGN.md section 5).

All verifiers take a ragged ``TreeBatch`` (node i's row of ``logits``/``probs`` is the target's
distribution of the token *after* node i, i.e. given the path root..i) and return an
``AcceptResult`` (accepted path, bonus token, vLLM-style ``output_tokens``).

* ``verify_greedy``: walk from the root; at a node take the target argmax (lowest token id on
  ties, like ``torch.argmax``); if a child carries it, accept that child and descend, else it is
  the bonus token. With duplicate sibling tokens the first (lowest index) child is followed.
* ``verify_target_only``: for children sets fixed before verification (e.g. deterministic top-k
  trees). At a node, one uniform u is an inverse CDF over the order [children in index order,
  then every other token in id order] with weights p(child) / p(token): u landing on a child
  accepts it and descends, u landing past the children samples the bonus from p with the children
  removed and renormalised (given u is past the children's mass P_C, (u - P_C)/(1 - P_C) is again
  uniform). A token that occurs under one parent several times counts once: the first occurrence
  gets its probability, later ones weight 0 (never accepted). Exact for any fixed children sets:
  the next token has law p and, given an accepted child, the walk continues from the target's
  conditional at that child.
* ``verify_traversal`` (re-exported from ``traversal``): for trees whose children are drawn from a
  drafter, Traversal Verification (arXiv 2505.12398).
* ``verify_tree``: the dispatcher: processes logits with per-request sampling parameters
  (``logits_processing``) and uses greedy for temperature-0 requests, the chosen stochastic method
  for the others.

Uniform layouts (float in [0, 1), one row per request; ``uniform_width`` gives the width):
    greedy: none (width 0);
    target_only: [R, Dmax + 1]; column d is read at the depth-d node of the accepted path;
    traversal: [R, 1 + 2N], see ``vllm_tfm.verify.traversal``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_tfm.tree.types import TreeBatch

from .accept_result import AcceptResult, accept_result_from_last_node
from .logits_processing import TreeSamplingParams, process_logits
from .traversal import sample_tree_from_draft, traversal_uniform_width, verify_traversal
from .tree_children import first_occurrence
from .tree_tables import TreeTables
from .uniforms import Generators, check_uniforms, draw_uniforms, inverse_cdf

__all__ = [
    "AcceptResult",
    "METHODS",
    "greedy_walk",
    "uniform_width",
    "verify_greedy",
    "verify_target_only",
    "verify_traversal",
    "verify_tree",
    "sample_tree_from_draft",
]

METHODS = ("target_only", "traversal")


def _check_rows(x: Tensor, trees: TreeBatch, name: str) -> None:
    if x.dim() != 2 or x.shape[0] != trees.num_nodes:
        raise ValueError(f"{name} must be [T={trees.num_nodes}, V] (one row per tree node), got {tuple(x.shape)}")


def uniform_width(trees: TreeBatch, method: str) -> int:
    """Columns of the uniforms a verifier reads for this batch: greedy 0, target_only Dmax + 1,
    traversal 1 + 2N (N = nodes of the largest tree)."""
    if method == "greedy":
        return 0
    if method == "target_only":
        return int(trees.depth.max()) + 1
    if method == "traversal":
        return traversal_uniform_width(trees)
    raise ValueError(f"unknown verification method {method!r}; expected 'greedy', 'target_only' or 'traversal'")


def _tables(trees: TreeBatch, tables: TreeTables | None) -> TreeTables:
    if tables is None:
        return TreeTables.of(trees)
    tables.check(trees)
    return tables


def verify_greedy(logits: Tensor, trees: TreeBatch, tables: TreeTables | None = None) -> AcceptResult:
    """Greedy tree acceptance. logits: [T, V] (any float dtype; only the argmax is used).

    tables: the batch's ``TreeTables`` (built from ``trees`` when None). Every node's next step
    (its first child carrying the target argmax, else itself) is computed at once; the walk from
    the roots is then ceil(log2 Dmax) rounds of pointer doubling instead of Dmax steps.
    """
    _check_rows(logits, trees, "logits")
    return greedy_walk(logits.argmax(dim=-1), trees, tables)


def greedy_walk(target: Tensor, trees: TreeBatch, tables: TreeTables | None = None) -> AcceptResult:
    """``verify_greedy`` from the target's argmax at every node (target: [T] int64): the walk and the result.
    The one-launch kernel ``vllm_tfm.kernels.greedy_accept`` computes the same (its reference calls this)."""
    tables = _tables(trees, tables)
    table = tables.children
    match = torch.where(table >= 0, trees.tokens[table.clamp(min=0)], -1) == target.unsqueeze(1)  # [T, C]
    first = match.long().argmax(dim=1, keepdim=True)  # first True
    nxt = torch.where(match.any(dim=1), table.gather(1, first).squeeze(1),
                      torch.arange(trees.num_nodes, device=target.device))
    steps = 1
    while steps < tables.max_depth:  # after Dmax steps every walk rests at a node that keeps itself
        nxt = nxt[nxt]
        steps *= 2
    cur = nxt[tables.starts] if tables.max_depth > 0 else tables.starts
    return accept_result_from_last_node(trees, cur, target[cur], tables)


WALK_CHUNK_ELEMENTS = 1 << 24
"""Entries of one chunk of the target-only decision rows ([rows, C + V] float64: 128 MiB, a few
times that in temporaries); more nodes than fit are decided in several chunks, which bounds the
verifier's transient memory (vLLM's memory profile does not see it). At a 248k vocabulary one
chunk holds ~67 nodes: a request's whole tree at B <= 64, so batch 1 runs in one chunk."""


def _target_only_decisions(probs: Tensor, trees: TreeBatch, tables: TreeTables, u: Tensor) -> Tensor:
    """[T] int64: the inverse-CDF outcome k of every node's acceptance step, for all nodes at once.

    Node i of request r at depth d reads uniform ``u[r, d]`` (the walk reaches depth d at its d-th
    step), so its decision does not depend on the walk and is computed before it. Its weights are
    [children's weights | p with the children's tokens removed]: a child's weight is p(child) for
    the first occurrence of a token among the children, else 0; the children's tokens are zeroed
    in the p row by one scatter (padding slots repeat the first child's token, writing its 0
    again; a node without children writes p[0] onto itself). k < C accepts child slot k, k >= C
    stops with bonus token k - C. Row by row the same float64 values, cumsum and comparison as a
    walk that builds the current nodes' rows at each depth, so the same outcomes bit for bit.
    """
    table = tables.children
    c = table.shape[1]
    valid = table >= 0
    tok = torch.where(valid, trees.tokens[table.clamp(min=0)], 0)
    counted = first_occurrence(tok, valid)
    cols = torch.where(valid, tok, tok[:, :1])
    at_cols = probs.gather(1, cols).to(torch.float64)
    child_w = torch.where(counted, at_cols, 0.0)
    removed = torch.where(valid[:, :1], 0.0, at_cols)
    scatter_cols = cols + c
    u_node = u[tables.node_request, trees.depth]  # [T]
    num_nodes = probs.shape[0]
    rows = max(1, WALK_CHUNK_ELEMENTS // (c + probs.shape[1]))
    ks = []
    for a in range(0, num_nodes, rows):
        b = min(a + rows, num_nodes)
        w = torch.cat([child_w[a:b], probs[a:b]], dim=1).scatter_(1, scatter_cols[a:b], removed[a:b])
        ks.append(inverse_cdf(w, u_node[a:b]))
    return ks[0] if len(ks) == 1 else torch.cat(ks)


def verify_target_only(
    probs: Tensor,
    trees: TreeBatch,
    generator: Generators = None,
    uniforms: Tensor | None = None,
    tables: TreeTables | None = None,
) -> AcceptResult:
    """Target-only tree acceptance (module docstring).

    probs: [T, V] processed target probabilities at every node. uniforms: [R, Dmax + 1] (column d
    at the depth-d node), else drawn from ``generator``. Decisions in float64. tables: the
    batch's ``TreeTables`` (built from ``trees`` when None). Every node's decision is computed at
    once (it reads the uniform of its own depth, so it does not depend on the walk); the walk
    from the roots is then ceil(log2 Dmax) rounds of pointer doubling, as in ``verify_greedy``.
    """
    _check_rows(probs, trees, "probs")
    tables = _tables(trees, tables)
    num_req = trees.num_requests
    dmax = tables.max_depth
    if uniforms is None:
        u = draw_uniforms(num_req, dmax + 1, probs.device, generator)
    else:
        u = check_uniforms(uniforms, num_req, dmax + 1, "verify_target_only").to(probs.device)
    c = tables.max_children
    k = _target_only_decisions(probs, trees, tables, u)
    stop = k >= c
    child = tables.children.gather(1, k.clamp(max=c - 1).unsqueeze(1)).squeeze(1)
    nxt = torch.where(stop, torch.arange(trees.num_nodes, device=probs.device), child)
    steps = 1
    while steps < dmax:  # after Dmax steps every walk rests at a node that stops
        nxt = nxt[nxt]
        steps *= 2
    cur = nxt[tables.starts] if dmax > 0 else tables.starts
    return accept_result_from_last_node(trees, cur, k[cur] - c, tables)


def verify_tree(
    logits: Tensor,
    trees: TreeBatch,
    params: TreeSamplingParams,
    method: str = "target_only",
    generator: Generators = None,
    uniforms: Tensor | None = None,
    draft_probs: Tensor | None = None,
    tables: TreeTables | None = None,
) -> AcceptResult:
    """Verify a ragged batch with per-request sampling parameters.

    logits: [T, V] raw target logits at every node. params: [R] parameters (logits_processing).
    method: "target_only" (fixed children sets) or "traversal" (children drawn from a drafter;
        needs ``draft_probs`` [T, V] or ``trees.draft_logprobs``).
    Temperature-0 requests are verified greedily on the raw logits and ignore their uniforms row;
    the other requests use ``method`` on the processed probabilities. uniforms: the method's
    layout ([R, uniform_width(trees, method)]), else drawn from ``generator``. tables: the
    batch's ``TreeTables`` (built from ``trees`` when None). When ``params`` carry a host copy of
    the greedy mask (``TreeSamplingParams.host_greedy``), the device is not read to choose the
    path and only the verifiers some request needs run.
    """
    if method not in METHODS:
        raise ValueError(f"unknown verification method {method!r}; expected one of {METHODS}")
    _check_rows(logits, trees, "logits")
    if params.num_requests != trees.num_requests:
        raise ValueError(f"params hold {params.num_requests} requests, the tree batch {trees.num_requests}")
    host = params.host_greedy
    any_greedy = host is None or bool(host.any())
    if any_greedy or method == "target_only":
        tables = _tables(trees, tables)
    greedy = verify_greedy(logits, trees, tables) if any_greedy else None
    if greedy is not None and host is not None and bool(host.all()):
        return greedy
    greedy_rows = None if greedy is None else params.greedy_mask().to(logits.device)
    if host is None and greedy_rows is not None and bool(greedy_rows.all()):  # reads the device (no host copy)
        return greedy
    probs = process_logits(logits, params, trees.cu_nodes)
    if method == "target_only":
        sampled = verify_target_only(probs, trees, generator, uniforms, tables)
    else:
        sampled = verify_traversal(probs, trees, draft_probs, generator, uniforms)
    return sampled if greedy is None or greedy_rows is None else greedy.select(greedy_rows, sampled)

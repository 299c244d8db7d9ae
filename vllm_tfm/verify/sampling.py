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
from .tree_children import child_table, first_occurrence
from .uniforms import Generators, check_uniforms, draw_uniforms, inverse_cdf

__all__ = [
    "AcceptResult",
    "METHODS",
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


def verify_greedy(logits: Tensor, trees: TreeBatch) -> AcceptResult:
    """Greedy tree acceptance. logits: [T, V] (any float dtype; only the argmax is used)."""
    _check_rows(logits, trees, "logits")
    target = logits.argmax(dim=-1)  # [T]
    table = child_table(trees)
    child_tokens = torch.where(table >= 0, trees.tokens[table.clamp(min=0)], -1)
    cur = trees.cu_nodes[:-1].clone()
    for _ in range(int(trees.depth.max())):
        match = child_tokens[cur] == target[cur].unsqueeze(1)  # [R, C]
        found = match.any(dim=1)
        first = match.long().argmax(dim=1)  # first True
        cur = torch.where(found, table[cur, first], cur)
    return accept_result_from_last_node(trees, cur, target[cur])


def verify_target_only(
    probs: Tensor, trees: TreeBatch, generator: Generators = None, uniforms: Tensor | None = None
) -> AcceptResult:
    """Target-only tree acceptance (module docstring).

    probs: [T, V] processed target probabilities at every node. uniforms: [R, Dmax + 1] (column d
    at the depth-d node), else drawn from ``generator``. Decisions in float64.
    """
    _check_rows(probs, trees, "probs")
    num_req = trees.num_requests
    dmax = int(trees.depth.max())
    if uniforms is None:
        u = draw_uniforms(num_req, dmax + 1, probs.device, generator)
    else:
        u = check_uniforms(uniforms, num_req, dmax + 1, "verify_target_only").to(probs.device)
    table = child_table(trees)
    num_slots = table.shape[1]
    rows = torch.arange(num_req, device=probs.device)
    cur = trees.cu_nodes[:-1].clone()
    done = torch.zeros(num_req, dtype=torch.bool, device=probs.device)
    bonus = torch.full((num_req,), -1, dtype=torch.long, device=probs.device)
    for d in range(dmax + 1):
        p = probs[cur].to(torch.float64)  # [R, V]
        children = table[cur]  # [R, C]
        valid = children >= 0
        tok = torch.where(valid, trees.tokens[children.clamp(min=0)], 0)
        counted = first_occurrence(tok, valid)
        w_children = torch.where(counted, p.gather(1, tok), 0.0)
        is_child = torch.zeros_like(p, dtype=torch.int32).scatter_add_(1, tok, valid.to(torch.int32)) > 0
        w_rest = torch.where(is_child, 0.0, p)
        k = inverse_cdf(torch.cat([w_children, w_rest], dim=1), u[:, d])
        to_child = k < num_slots
        live = ~done
        bonus = torch.where(live & ~to_child, k - num_slots, bonus)
        nxt = children[rows, k.clamp(max=num_slots - 1)]
        cur = torch.where(live & to_child, nxt, cur)
        done = done | ~to_child
    return accept_result_from_last_node(trees, cur, bonus)


def verify_tree(
    logits: Tensor,
    trees: TreeBatch,
    params: TreeSamplingParams,
    method: str = "target_only",
    generator: Generators = None,
    uniforms: Tensor | None = None,
    draft_probs: Tensor | None = None,
) -> AcceptResult:
    """Verify a ragged batch with per-request sampling parameters.

    logits: [T, V] raw target logits at every node. params: [R] parameters (logits_processing).
    method: "target_only" (fixed children sets) or "traversal" (children drawn from a drafter;
        needs ``draft_probs`` [T, V] or ``trees.draft_logprobs``).
    Temperature-0 requests are verified greedily on the raw logits and ignore their uniforms row;
    the other requests use ``method`` on the processed probabilities. uniforms: the method's
    layout ([R, uniform_width(trees, method)]), else drawn from ``generator``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown verification method {method!r}; expected one of {METHODS}")
    _check_rows(logits, trees, "logits")
    if params.num_requests != trees.num_requests:
        raise ValueError(f"params hold {params.num_requests} requests, the tree batch {trees.num_requests}")
    greedy_rows = params.greedy_mask().to(logits.device)
    greedy = verify_greedy(logits, trees)
    if bool(greedy_rows.all()):
        return greedy
    probs = process_logits(logits, params, trees.cu_nodes)
    if method == "target_only":
        sampled = verify_target_only(probs, trees, generator, uniforms)
    else:
        sampled = verify_traversal(probs, trees, draft_probs, generator, uniforms)
    return greedy.select(greedy_rows, sampled)

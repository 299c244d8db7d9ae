"""Batched chain and DDTree trees from per-depth marginals: R requests at once, on their device.

Shared by the vLLM runtime (``vllm_plugin.runtime.tree_builder_gpu``) and the acceptance replay
(``vllm_tfm.reference.replay``). Every builder returns a padded batch ``tokens [R, B]`` (draft
tokens, node j + 1 of the tree is column j) and ``parents [R, 1 + B]`` (local parents, -1 at the
root), nodes in topological order, completed to exactly B draft nodes by ``fill_to_budget``.

* ``chain_trees``: the argmax of each depth's marginal (plain DFlash).
* ``ddtree_trees``: DDTree (liranringel/ddtree, best-first from per-depth marginals) computed
  without a heap. Path scores are sums of per-depth log-probabilities and every step of the
  best-first search pops the smallest key ``(-score, rank path)``; the B popped nodes are the B
  smallest keys over all prefixes (see ``vllm_tfm.tree.ddtree``). We get them depth by depth:
  the best B prefixes of depth d are among {best B prefixes of depth d - 1} x {ranks < B} (a
  prefix with a worse parent or a rank >= B has B better same-depth prefixes), so each depth is
  one sort of B * B candidates laid out in rank-path order (the stable sort then breaks score
  ties exactly like the reference), and the final B nodes are the B smallest keys of the union.
  Same tokens, parents and order as ``vllm_tfm.tree.build_ddtree`` (tested against it).
Determinism: sorts are stable and scores are accumulated in float64 in a fixed order, so equal
inputs give equal trees on every tensor-parallel rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .padded import fill_to_budget, stable_topk

__all__ = ["chain_trees", "check_marginals", "ddtree_trees", "ranked_top"]

NEG_INF = float("-inf")


def check_marginals(logprobs: Tensor, budget: int) -> None:
    if logprobs.dim() != 3 or 0 in logprobs.shape:
        raise ValueError(f"marginal log-probabilities must be [R, D, V] and non-empty, got {tuple(logprobs.shape)}")
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"the tree budget must be an integer >= 1, got {budget!r}")


def ranked_top(logprobs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best entries of every depth, best first: (values [R, D, k] float64, token ids [R, D, k]).

    The order of a stable descending sort (ties: lower token id first), like
    ``vllm_tfm.tree._common.ranked``, without sorting whole vocabulary rows (``stable_topk``: one
    ``topk`` over distinct int64 keys for float32/16 rows of more than 1024 entries, a sort
    otherwise). Columns past V hold -inf.
    """
    vals, idx = stable_topk(logprobs, k)
    vals = vals.to(torch.float64)
    if vals.shape[-1] < k:
        pad = k - vals.shape[-1]
        vals = torch.cat([vals, vals.new_full((*vals.shape[:-1], pad), NEG_INF)], dim=-1)
        idx = torch.cat([idx, idx.new_zeros((*idx.shape[:-1], pad))], dim=-1)
    return vals, idx


def chain_trees(logprobs: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """Chains of the per-depth argmax (lowest id on ties), completed to ``budget`` nodes.

    logprobs: [R, D, V]. Returns tokens [R, B] int64, parents [R, 1 + B] int64.
    """
    check_marginals(logprobs, budget)
    r, d, _ = logprobs.shape
    dev = logprobs.device
    top = logprobs.argmax(dim=-1)  # [R, D]
    depth = min(d, budget)
    tokens = torch.zeros(r, budget, dtype=torch.long, device=dev)
    tokens[:, :depth] = top[:, :depth]
    parents = torch.arange(-1, budget, device=dev).expand(r, budget + 1).clone()
    num_nodes = torch.full((r,), depth + 1, dtype=torch.long, device=dev)
    return fill_to_budget(tokens, parents, num_nodes, top[:, depth - 1])


def ddtree_trees(logprobs: Tensor, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """DDTree trees (module docstring) of up to ``budget`` nodes, in the reference's pop order.

    logprobs: [R, D, V] log-probabilities (float32 or float64; -inf entries are never drafted).
    Returns tokens [R, B] int64, parents [R, 1 + B] int64 (completed by ``fill_to_budget``) and
    num_nodes [R] int64, the nodes DDTree itself chose (root included) before completion.
    """
    check_marginals(logprobs, budget)
    r, depth, _ = logprobs.shape
    b = budget
    dev = logprobs.device
    vals, ids = ranked_top(logprobs, b)  # [R, D, B]
    ar_b = torch.arange(b, device=dev)

    # Depth 1: the B best ranks, already in (score desc, rank path) order; lex rank = rank.
    scores = [vals[:, 0, :]]  # per depth: [R, B] float64
    digits = [torch.full((r, b, depth), -1, dtype=torch.long, device=dev)]
    digits[0][:, :, 0] = ar_b
    tokens = [ids[:, 0, :]]
    parent_slot = [torch.full((r, b), -1, dtype=torch.long, device=dev)]  # index into the union
    lexrank = ar_b.expand(r, b)
    for d in range(1, depth):
        prev_score = scores[-1]
        # candidates laid out in rank-path order: parents by lex rank, then child rank
        parent_by_lex = torch.argsort(lexrank, dim=1)  # [R, B] slot of the parent with lex rank i
        cand_parent = parent_by_lex[:, :, None].expand(r, b, b).reshape(r, b * b)
        cand_rank = ar_b.repeat(b).expand(r, b * b)
        cand_score = prev_score.gather(1, cand_parent) + vals[:, d, :].gather(1, cand_rank)
        order = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :b]
        sel_parent = cand_parent.gather(1, order)
        sel_rank = cand_rank.gather(1, order)
        scores.append(cand_score.gather(1, order))
        dig = digits[-1].gather(1, sel_parent[:, :, None].expand(r, b, depth)).clone()
        dig[:, :, d] = sel_rank
        digits.append(dig)
        tokens.append(ids[:, d, :].gather(1, sel_rank))
        parent_slot.append((d - 1) * b + sel_parent)
        lexrank = torch.argsort(torch.argsort(order, dim=1), dim=1)  # candidate order is lex order

    u_score = torch.cat(scores, dim=1)  # [R, D*B]
    u_digits = torch.cat(digits, dim=1)  # [R, D*B, D]
    u_token = torch.cat(tokens, dim=1)
    u_parent = torch.cat(parent_slot, dim=1)
    # lexicographic order of the rank paths (LSD radix: stable sorts from the last digit)
    perm = torch.arange(u_score.shape[1], device=dev).expand(r, -1)
    for k in reversed(range(depth)):
        key = u_digits[:, :, k].gather(1, perm)
        perm = perm.gather(1, torch.sort(key, dim=1, stable=True).indices)
    by_score = torch.sort(u_score.gather(1, perm), dim=1, descending=True, stable=True).indices
    chosen = perm.gather(1, by_score)[:, :b]  # union slots of the B best keys, in pop order
    valid = u_score.gather(1, chosen) > NEG_INF
    num_nodes = 1 + valid.sum(dim=1)
    out_pos = torch.full_like(u_parent, -1)  # union slot -> node index (0 = root for depth-1 parents)
    out_pos.scatter_(1, chosen, torch.where(valid, ar_b[None, :] + 1, -1))
    par_slot = u_parent.gather(1, chosen)
    par_node = torch.where(par_slot >= 0, out_pos.gather(1, par_slot.clamp(min=0)), 0)
    out_tokens = torch.where(valid, u_token.gather(1, chosen), 0)
    out_parents = torch.cat([torch.full((r, 1), -1, dtype=torch.long, device=dev), par_node], dim=1)
    filler = ids[:, 0, 0]
    out_tokens, out_parents = fill_to_budget(out_tokens, out_parents, num_nodes, filler)
    return out_tokens, out_parents, num_nodes

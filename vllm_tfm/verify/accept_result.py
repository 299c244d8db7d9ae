"""The outcome of verifying a ragged batch of trees: accepted path, bonus token, output tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_tfm.tree.types import TreeBatch

__all__ = ["AcceptResult", "accept_result_from_last_node"]


@dataclass(frozen=True)
class AcceptResult:
    """Per-request result of tree verification (R requests, Dmax = max tree depth in the batch).

    accepted_nodes: [R, Dmax] int64, local indices of the accepted drafts root..last (root
        excluded), -1 padding.
    num_accepted: [R] int64, number of accepted drafts (= depth of ``last_node``).
    last_node: [R] int64, local index of the deepest accepted node (0 = only the root).
    bonus: [R] int64, the token sampled after the accepted path.
    output_tokens: [R, Dmax + 1] int64, the accepted drafts' tokens, then the bonus, then -1
        (vLLM's ``sampled_token_ids`` layout, which vLLM keeps as int32).
    """

    accepted_nodes: Tensor
    num_accepted: Tensor
    last_node: Tensor
    bonus: Tensor
    output_tokens: Tensor

    def select(self, mask: Tensor, other: "AcceptResult") -> "AcceptResult":
        """Row-wise merge: rows where mask [R] is True come from self, the others from ``other``."""
        m1 = mask.unsqueeze(1)
        return AcceptResult(
            torch.where(m1, self.accepted_nodes, other.accepted_nodes),
            torch.where(mask, self.num_accepted, other.num_accepted),
            torch.where(mask, self.last_node, other.last_node),
            torch.where(mask, self.bonus, other.bonus),
            torch.where(m1, self.output_tokens, other.output_tokens),
        )


def accept_result_from_last_node(trees: TreeBatch, last_global: Tensor, bonus: Tensor) -> AcceptResult:
    """Build the AcceptResult from the deepest accepted node of each request and its bonus token.

    last_global: [R] int64, flat (batch) index of each request's deepest accepted node.
    bonus: [R] int64. The path is recovered by walking the parents up to the root.
    """
    num_req = trees.num_requests
    dmax = int(trees.depth.max())
    device = trees.tokens.device
    starts = trees.cu_nodes[:-1]
    gparents = trees.global_parents()
    rows = torch.arange(num_req, device=device)
    num_accepted = trees.depth[last_global]
    accepted = torch.full((num_req, max(dmax, 1)), -1, dtype=torch.long, device=device)
    tokens_out = torch.full((num_req, dmax + 1), -1, dtype=torch.long, device=device)
    cur = last_global
    for _ in range(dmax):
        d = trees.depth[cur]
        on_path = d > 0
        col = (d - 1).clamp(min=0)
        accepted[rows, col] = torch.where(on_path, cur - starts, accepted[rows, col])
        tokens_out[rows, col] = torch.where(on_path, trees.tokens[cur], tokens_out[rows, col])
        cur = torch.where(on_path, gparents[cur], cur)
    tokens_out[rows, num_accepted] = bonus
    return AcceptResult(accepted[:, :dmax], num_accepted, last_global - starts, bonus, tokens_out)

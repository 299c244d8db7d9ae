"""The outcome of verifying a ragged batch of trees: accepted path, bonus token, output tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_tfm.tree.types import TreeBatch

from .tree_tables import TreeTables

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


def accept_result_from_last_node(
    trees: TreeBatch, last_global: Tensor, bonus: Tensor, tables: TreeTables | None = None
) -> AcceptResult:
    """Build the AcceptResult from the deepest accepted node of each request and its bonus token.

    last_global: [R] int64, flat (batch) index of each request's deepest accepted node.
    bonus: [R] int64. tables: the batch's ``TreeTables`` (built from ``trees`` when None, which
    reads the tree shape back from the device). The accepted path is the row of ``tables.paths``
    of the last node: a fixed number of torch calls, whatever the depth.
    """
    if tables is None:
        tables = TreeTables.of(trees)
    dmax = tables.max_depth
    starts = tables.starts
    num_accepted = trees.depth[last_global]
    path = tables.paths[last_global, 1:]  # [R, Dmax]: the accepted drafts root-first, -1 past the last
    on_path = path >= 0
    accepted = torch.where(on_path, path - starts[:, None], -1)
    tokens_out = torch.full((tables.num_requests, dmax + 1), -1, dtype=torch.long, device=path.device)
    tokens_out[:, :dmax] = torch.where(on_path, trees.tokens[path.clamp(min=0)], -1)
    tokens_out.scatter_(1, num_accepted[:, None], bonus.to(torch.long)[:, None])
    return AcceptResult(accepted, num_accepted, last_global - starts, bonus, tokens_out)

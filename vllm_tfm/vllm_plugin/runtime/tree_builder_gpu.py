"""Batched tree construction from the DFlash marginals, on the device of the marginals.

Every builder returns a padded batch ``tokens [R, B]`` (draft tokens, node j + 1 of the tree is
column j) and ``parents [R, 1 + B]`` (local parents, -1 at the root), nodes in topological order,
exactly B draft nodes per request: vLLM moves a fixed number of draft tokens per request per
step, so a tree that comes out smaller (a chain shallower than B, a DDTree whose candidate space
ran dry) is completed by ``fill_to_budget``.

* ``chain_trees``, ``ddtree_trees``: ``vllm_tfm.tree.marginal_padded`` (plain DFlash and DDTree).
* ``weaver_trees``: the TfM proposal; the Weaver re-scores the DFlash top-K candidates along each
  node's path (``vllm_tfm.models.BatchedWeaverTreeScorer``) while ``vllm_tfm.tree.build_weaver_padded``
  grows all requests' trees in lockstep: one Weaver call per step for every request, about
  ceil(B / w) steps, one host sync at the end (``vllm_tfm.models.proposal_trees``). Same trees as
  ``vllm_tfm.tree.build_weaver`` per request (to Weaver rounding). The steps before that sync have
  fixed shapes and update their state in place: ``weaver_graphs`` replays them as CUDA graphs
  (the default; ``VLLM_TFM_WEAVER_GRAPHS=0`` builds eagerly).

Determinism: sorts are stable and scores are accumulated in float64 in a fixed order, so equal
inputs give equal trees on every tensor-parallel rank.
"""

from __future__ import annotations

from torch import Tensor, nn

from vllm_tfm.models.proposal_trees import weaver_draft_trees
from vllm_tfm.models.vocab_table import VocabTable
from vllm_tfm.tree.marginal_padded import (
    chain_trees,
    check_marginals,
    ddtree_trees,
    ranked_top,
)
from vllm_tfm.tree.padded import fill_to_budget

__all__ = ["chain_trees", "ddtree_trees", "fill_to_budget", "ranked_top", "weaver_trees"]


def weaver_trees(
    weaver: nn.Module,
    dflash_logits: Tensor,
    dflash_hidden: Tensor,
    verifier_hidden: Tensor,
    root_tokens: Tensor,
    embed: VocabTable,
    lm_head: VocabTable,
    budget: int,
    top_k: int,
    width: int,
    children_per_node: int,
) -> tuple[Tensor, Tensor]:
    """TfM trees: Weaver-scored best-first growth of all requests at once (module docstring).

    dflash_logits: [R, D, V] raw DFlash logits; dflash_hidden: [R, D, H] DFlash outputs (after
    its final norm) at block slots 1..D; verifier_hidden: [R, H] the target's final hidden state
    at the row that produced each root (bonus) token; root_tokens: [R].
    Returns tokens [R, B], parents [R, 1 + B] (completed by ``fill_to_budget``). The candidates'
    DFlash logits are held in the Weaver's dtype (``dflash_hidden.dtype``) before scoring.
    """
    check_marginals(dflash_logits, budget)
    return weaver_draft_trees(
        weaver, dflash_logits, dflash_hidden, verifier_hidden, root_tokens, embed, lm_head,
        budget, top_k, width, children_per_node, logits_dtype=dflash_hidden.dtype,
    )

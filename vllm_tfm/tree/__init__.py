"""Token trees (``types``) and the tree builders: chain, DDTree, Weaver (DySpec-w), TreeFlash.

Every builder takes the root (last committed) token, a budget B of draft nodes (root excluded) and
a max depth, and returns a ``Tree`` of at most 1 + B nodes in topological order with ``scores``
(path log-probabilities under the proposal, root 0) and ``draft_logprobs`` (log q(node | parent),
root 0). The ``*_batch`` variants return a ragged ``TreeBatch`` (a loop over requests, the
reference). ``build_weaver_padded`` / ``build_treeflash_padded`` grow the trees of R requests
together on the device with batched scorers and return ``PaddedTrees`` ([R, 1 + B] tensors), the
same trees as the per-request builders.
"""

from .chain import build_chain, build_chain_batch
from .ddtree import build_ddtree, build_ddtree_batch
from .padded import PaddedTrees, fill_to_budget
from .treeflash import TransitionScorer, build_treeflash, build_treeflash_batch
from .treeflash_padded import BatchedTransitionScorer, build_treeflash_padded
from .types import Tree, TreeBatch, ancestor_mask, depths_from_parents, pack_bitmask
from .weaver import WeaverScorer, build_weaver, build_weaver_batch, default_weaver_width
from .weaver_padded import BatchedWeaverScorer, build_weaver_padded

__all__ = [
    "Tree",
    "TreeBatch",
    "ancestor_mask",
    "depths_from_parents",
    "pack_bitmask",
    "build_chain",
    "build_chain_batch",
    "build_ddtree",
    "build_ddtree_batch",
    "build_weaver",
    "build_weaver_batch",
    "default_weaver_width",
    "WeaverScorer",
    "build_treeflash",
    "build_treeflash_batch",
    "TransitionScorer",
    "PaddedTrees",
    "fill_to_budget",
    "build_weaver_padded",
    "BatchedWeaverScorer",
    "build_treeflash_padded",
    "BatchedTransitionScorer",
]

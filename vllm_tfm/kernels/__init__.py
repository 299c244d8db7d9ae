"""CUDA kernels for tree verification, compiled at run time by NVRTC (sources in ``cuda/``).

Each public function has the signature of its torch reference in ``vllm_tfm.verify`` and computes
the same function; when the kernels cannot run (no CUDA device, no cuda-python/NVRTC, an
unsupported dtype or shape) it calls the reference instead and says so once.

* :func:`gdn_tree_verify`, :func:`gdn_tree_commit`: Gated DeltaNet over a token tree.
* :func:`tree_causal_conv1d`, :func:`tree_conv_commit`: the short causal conv over a tree.
* :class:`TreePlan` and the ``*_planned`` variants: the per-step index tables, built once and
  shared by every layer.
* :func:`gdn_tree_commit_layers`, :func:`tree_conv_commit_layers`, :func:`commit_layers_planned`:
  the commits of many layers in one launch per kernel kind (``batched_commit``).
* ``weaver_round.round_fn_for``: one launch per Weaver growth round (its torch reference is
  ``vllm_tfm.tree.weaver_padded.weaver_round_reference``, the same signature).
* :func:`kv_compact_layers`: the K/V moves of the accepted tree paths in every full-attention layer of
  a KV-cache group, one launch (its torch reference :func:`kv_compact_reference`, the same signature;
  :func:`kv_compact_unsupported_reason` says when the kernel cannot run).
* ``greedy_accept.tree_greedy_accept``: greedy tree acceptance of a ragged batch in one launch (its torch
  reference ``tree_greedy_accept_reference`` runs ``vllm_tfm.verify.sampling.greedy_walk``).
* ``context_order.dflash_context_order_kernel``: the DFlash drafter's context order of a tree step's rows in one
  launch (its torch reference ``dflash_context_order_reference``, the same signature).
* :func:`kernels_available`: whether the CUDA path can run on this machine.
"""

from vllm_tfm.kernels.batched_commit import (
    commit_layers_planned,
    gdn_tree_commit_layers,
    tree_conv_commit_layers,
)
from vllm_tfm.kernels.conv import (
    tree_causal_conv1d,
    tree_causal_conv1d_planned,
    tree_conv_commit,
    tree_conv_commit_planned,
)
from vllm_tfm.kernels.gdn import (
    gdn_tree_commit,
    gdn_tree_commit_planned,
    gdn_tree_verify,
    gdn_tree_verify_planned,
)
from vllm_tfm.kernels.kv_compact import (
    kv_compact_layers,
    kv_compact_reference,
    kv_compact_unsupported_reason,
)
from vllm_tfm.kernels.loader import KernelCompileError, KernelLaunchError, kernels_available
from vllm_tfm.kernels.plan import CommitIndices, TreePlan

__all__ = [
    "CommitIndices",
    "KernelCompileError",
    "KernelLaunchError",
    "TreePlan",
    "commit_layers_planned",
    "gdn_tree_commit",
    "gdn_tree_commit_layers",
    "gdn_tree_commit_planned",
    "gdn_tree_verify",
    "gdn_tree_verify_planned",
    "kernels_available",
    "kv_compact_layers",
    "kv_compact_reference",
    "kv_compact_unsupported_reason",
    "tree_causal_conv1d",
    "tree_causal_conv1d_planned",
    "tree_conv_commit",
    "tree_conv_commit_layers",
    "tree_conv_commit_planned",
]

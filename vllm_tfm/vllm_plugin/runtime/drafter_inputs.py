"""Inputs of the DFlash drafter after a tree step: context row order and the bonus rows.

After a tree-active step the root and the accepted path of a request are scattered among its
1 + B verified rows. The DFlash proposer (vLLM's ``DFlashProposer``) takes the first
``rows - num_rejected`` rows of each request as valid context, at the positions it is given, so
``dflash_context_order`` moves root + accepted path to the front (the drafter is then given the
sequential positions ``ctx + k`` of the rows, see proposer.py). ``bonus_rows`` finds the logits
row whose target hidden state produced each bonus token (the Weaver's prompt token 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_tfm.kernels import context_order as kco
from vllm_tfm.kernels.loader import warn_fallback

from .kernels_or_reference import kernels_enabled
from .settings import RuntimeSwitch
from .state import STATE

__all__ = ["CONTEXT_ORDER_KERNEL_ENV", "bonus_rows", "context_order_kernel_enabled", "dflash_context_order",
           "set_context_order_kernel"]


CONTEXT_ORDER_KERNEL_ENV = "VLLM_TFM_CONTEXT_ORDER_KERNEL"
_COK = RuntimeSwitch(CONTEXT_ORDER_KERNEL_ENV, "set_context_order_kernel")


def context_order_kernel_enabled() -> bool:
    """``VLLM_TFM_CONTEXT_ORDER_KERNEL`` unset or not 0 / false (default on), unless ``set_context_order_kernel``
    overrode it: ``dflash_context_order`` runs one kernel launch instead of the torch reference's ~20."""
    return _COK.enabled()


def set_context_order_kernel(on: bool | None) -> bool:
    """Override ``VLLM_TFM_CONTEXT_ORDER_KERNEL`` in this process (None: back to the environment's); the setting
    now in force. For a same-engine A/B through ``collective_rpc``."""
    return _COK.set(on)


def dflash_context_order(
    req_index: Tensor, row_base: Tensor, rows_per_req: Tensor, accepted_nodes: Tensor
) -> Tensor:
    """Permutation [T] of the step's rows: per request, rows before the root, the root, the
    accepted path in depth order, then the remaining rows in their order. No host sync.

    req_index: [T] request of each row; row_base: [R] row of each request's root (first logits
    row); rows_per_req: [R] scheduled rows; accepted_nodes: [R, Dmax] local node indices of the
    accepted path (-1 padding), node j being row ``row_base + j``. One launch of
    ``vllm_tfm.kernels.context_order`` where the CUDA kernels run (``VLLM_TFM_CONTEXT_ORDER_KERNEL``, default
    on), else its torch reference (the same permutation).
    """
    if context_order_kernel_enabled() and kernels_enabled():
        reason = kco.unsupported_reason(req_index, row_base, rows_per_req, accepted_nodes)
        if reason is None:
            if STATE.metrics is not None:
                STATE.metrics.hook("proposer.context_order_kernel")
            return kco.launch_unchecked(req_index, row_base, accepted_nodes)
        if reason != kco.NOT_CUDA:
            warn_fallback("dflash_context_order", reason)
    return kco.dflash_context_order_reference(req_index, row_base, rows_per_req, accepted_nodes)


def bonus_rows(sample_start: Tensor, last_node: Tensor) -> Tensor:
    """Logits row that produced each request's bonus token: [R] = sample_start + last accepted node."""
    return sample_start.to(torch.long) + last_node.to(torch.long)

"""The DFlash drafter's context order of a tree step's rows in one launch (``cuda/context_order.cu``).

After a tree step the drafter's context must hold, per request, the rows before the root, the root, the
accepted path in depth order, and then the request's other rows in their order (the drafter writes its
context K/V at those rows, so the rejected nodes' rows come last, where the next step overwrites them).
``dflash_context_order_reference`` computes this permutation with torch (keys and a stable argsort, ~20
launches); ``dflash_context_order_kernel`` with one launch that places every row directly. The two agree
entry for entry (tests/cpu/test_context_order_kernel.py through the CPU emulation,
tests/gpu/test_context_order_gpu.py).

Arguments (both functions):

* ``req_index``: [T] the request of each scheduled row (rows of a request contiguous, requests in order:
  vLLM's batch layout; the kernel relies on it, the reference does not);
* ``row_base``: [R] the row of each request's root (its first logits row);
* ``rows_per_req``: [R] each request's scheduled rows;
* ``accepted_nodes``: [R, Dmax] local node indices of the accepted path in depth order, -1 padding; node j
  of request r is row ``row_base[r] + j``.

Returns perm int64 [T]: the rows in their new order (``hidden[perm]`` is the drafter's context).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from vllm_tfm.kernels.loader import get_kernel, kernels_unavailable_reason, launch, tensor_device_index

__all__ = ["NOT_CUDA", "dflash_context_order_kernel", "dflash_context_order_reference", "launch_unchecked",
           "unsupported_reason"]

SOURCE = "context_order.cu"
THREADS = 128  # CO_THREADS
NOT_CUDA = "the tensors are not all on one CUDA device"


def dflash_context_order_reference(req_index: Tensor, row_base: Tensor, rows_per_req: Tensor,
                                   accepted_nodes: Tensor) -> Tensor:
    """The permutation with torch (module docstring): per request, rows before the root and the root by
    position, then the accepted path by depth, then the other rows by position; a stable argsort of
    (request, key). No host synchronisation."""
    t = req_index.shape[0]
    dev = req_index.device
    req = req_index.to(torch.long)
    base = row_base.to(torch.long)
    local = torch.arange(t, device=dev) - base[req]
    valid = accepted_nodes >= 0
    rank = torch.arange(1, accepted_nodes.shape[1] + 1, device=dev).expand_as(accepted_nodes)
    rows = torch.where(valid, base[:, None] + accepted_nodes, t)  # padding -> a spare slot
    path_rank = torch.zeros(t + 1, dtype=torch.long, device=dev)
    path_rank.scatter_(0, rows.reshape(-1), torch.where(valid, rank, 0).reshape(-1))
    path_rank = path_rank[:t]
    n = rows_per_req.to(torch.long)[req]
    key = torch.where(local <= 0, local, torch.where(path_rank > 0, path_rank, n + local))
    span = 4 * t + 4
    return torch.argsort(req * span + key + 2 * t + 2, stable=True)


def _shape_error(req_index: Tensor, row_base: Tensor, rows_per_req: Tensor, accepted_nodes: Tensor) -> str | None:
    def vector(x: Tensor) -> bool:
        return x.dim() == 1 and x.dtype == torch.int64 and x.is_contiguous()

    if not vector(req_index):
        return f"req_index must be a contiguous int64 [T] tensor, got {req_index.dtype} {tuple(req_index.shape)}"
    if not vector(row_base):
        return f"row_base must be a contiguous int64 [R] tensor, got {row_base.dtype} {tuple(row_base.shape)}"
    r = row_base.shape[0]
    if rows_per_req.dim() != 1 or rows_per_req.shape[0] != r:
        return f"rows_per_req must be a [{r}] tensor, got {tuple(rows_per_req.shape)}"
    if (accepted_nodes.dim() != 2 or accepted_nodes.shape[0] != r or accepted_nodes.dtype != torch.int64
            or not accepted_nodes.is_contiguous()):
        return (f"accepted_nodes must be a contiguous int64 [{r}, Dmax] tensor, got {accepted_nodes.dtype} "
                f"{tuple(accepted_nodes.shape)}")
    if req_index.shape[0] >= 2**31:
        return f"{req_index.shape[0]} rows: the kernel takes fewer than 2**31"
    return None


def unsupported_reason(req_index: Tensor, row_base: Tensor, rows_per_req: Tensor, accepted_nodes: Tensor) -> str | None:
    """None when the kernel takes these arguments, else why not (host metadata only)."""
    reason = _shape_error(req_index, row_base, rows_per_req, accepted_nodes)
    if reason is not None:
        return reason
    tensors = (req_index, row_base, accepted_nodes)
    if not all(x.is_cuda for x in tensors) or len({x.device for x in tensors}) != 1:
        return NOT_CUDA
    return kernels_unavailable_reason(req_index.device.index)


def dflash_context_order_kernel(req_index: Tensor, row_base: Tensor, rows_per_req: Tensor,
                                accepted_nodes: Tensor) -> Tensor:
    """The launch (module docstring); raises ValueError for arguments ``unsupported_reason`` rejects on their
    shapes. ``rows_per_req`` is not read (a request's rows after its root need no count here). No host
    synchronisation."""
    reason = _shape_error(req_index, row_base, rows_per_req, accepted_nodes)
    if reason is not None:
        raise ValueError(f"dflash_context_order: {reason}")
    return launch_unchecked(req_index, row_base, accepted_nodes)


def launch_unchecked(req_index: Tensor, row_base: Tensor, accepted_nodes: Tensor) -> Tensor:
    """The launch itself, for arguments ``unsupported_reason`` accepted (not checked again: the runtime's
    per-step dispatch checks once)."""
    t = req_index.shape[0]
    perm = torch.empty(t, dtype=torch.int64, device=req_index.device)
    if t == 0:
        return perm
    kernel = get_kernel(SOURCE, "dflash_context_order", ["--std=c++17", "-lineinfo"], tensor_device_index(req_index))
    i32 = ctypes.c_int
    launch(kernel, ((t + THREADS - 1) // THREADS, 1, 1), (THREADS, 1, 1),
           [req_index, row_base, accepted_nodes, i32(accepted_nodes.shape[1]), i32(t), perm])
    return perm

"""The k largest entries of every row in one launch (``cuda/topk_rows.cu``): the DFlash top-K of the
Weaver tree build.

``topk_candidates(logits, k)`` is what ``models.proposal_trees`` calls for the DFlash candidates (k = 512
of 248,320 logits per depth at the Qwen3.6-27B shape). Before, that was ``torch.topk`` on a float32 copy
of the bf16 logits: ~55 us of a batch-1 step and ~330 us of a batch-8 step in the e2e kernel profile
(bench/NOTES.md sections 40 and 47). The kernel reads the 16-bit logits once, keeps each row in shared
memory across a thread block cluster and finds the k-th value by radix selection (the source's comment
has the algorithm and the ordering argument).

Order, in the kernel and in ``topk_rows_reference`` (its oracle, the same signature): values descending,
ties to the lower index; -0.0 ties with 0.0; NaN ranks above everything (as in ``torch.topk``). That is
``vllm_tfm.tree.padded.stable_topk``'s order on NaN-free rows. ``torch.topk`` orders ties in no fixed way,
so the kernel's candidate list can differ from the torch path's only in the order (and, at the k-th
place, the choice) of equal logits; verification is exact for any tree, so tokens do not depend on it.

The kernel takes CUDA float32 / bfloat16 / float16 rows with a contiguous last dimension, 1 <= k <=
min(V, :data:`MAX_K`), and rows whose chunk fits one CTA's shared memory at a cluster of at most
:data:`MAX_CLUSTER` (V up to ~800k 16-bit values). ``topk_candidates(..., kernel=False)`` keeps
``torch.topk`` (the runtime's switch ``VLLM_TFM_TOPK_KERNEL`` lives in
``vllm_plugin/runtime/tree_builder_gpu.py``); any input the kernel does not take falls back to it too (a
one-time warning for CUDA inputs).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from vllm_tfm.kernels.loader import (
    device_smem_optin,
    get_kernel,
    kernels_unavailable_reason,
    launch,
    tensor_device_index,
    warn_fallback,
)

__all__ = [
    "MAX_CLUSTER",
    "MAX_K",
    "NOT_CUDA",
    "launch_plan",
    "topk_candidates",
    "topk_rows",
    "topk_rows_reference",
    "topk_rows_unsupported_reason",
    "topk_smem_bytes",
]

SOURCE = "topk_rows.cu"
THREADS = 256  # TK_THREADS
MAX_BINS = 4096  # TK_MAX_BINS
MAX_CLUSTER = 8  # TK_MAX_CLUSTER
MAX_K = 1024  # TK_MAX_K
MISC_INTS = 64  # TK_MISC
MAX_GRID_Y = 65535
SMEM_TARGET = 100 * 1024  # per CTA: two CTAs per SM (228 KB) where the rows allow
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NOT_CUDA = "the logits are not a CUDA tensor"


def topk_rows_reference(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values float32 [..., k], indices int64 [..., k]): the k largest entries of each row of ``x``
    [..., V] (float32, bfloat16 or float16), best first, ties to the lower index, NaN first: a stable
    descending sort (torch's sort puts NaN above every number and -0.0 level with 0.0), truncated."""
    if x.dtype not in DTYPE_CODE:
        raise ValueError(f"topk_rows_reference: x must be float32, bfloat16 or float16, got {x.dtype}")
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"topk_rows_reference: k must be in [1, {x.shape[-1]}], got {k}")
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    return vals[..., :k].float(), idx[..., :k]


def _pow2_at_least(n: int) -> int:
    return 1 << max(1, (n - 1).bit_length())


def topk_smem_bytes(chunk: int, cluster: int, k: int, element_size: int) -> int:
    """Dynamic shared memory of one CTA (mirrors tk_smem_bytes in the source)."""
    return ((chunk * element_size + 15) & ~15) + 4 * MAX_BINS + 4 * (MAX_BINS // cluster) + 8 * _pow2_at_least(k) \
        + 4 * 2 * THREADS + 4 * MISC_INTS


def launch_plan(rows: int, v: int, k: int, element_size: int, num_sms: int, max_smem: int,
                cluster: int | None = None) -> tuple[int, int, int] | str:
    """(cluster, chunk, shared memory bytes) of a call, or why the kernel does not take it. The cluster
    doubles from 1 while a CTA's shared memory is over :data:`SMEM_TARGET` or the grid has fewer CTAs
    than SMs, up to :data:`MAX_CLUSTER` (at most one CTA per 256 entries); ``cluster`` forces it."""
    if not 1 <= k <= min(v, MAX_K):
        return f"k = {k} with V = {v}: the kernel takes 1 <= k <= min(V, {MAX_K})"
    if rows > MAX_GRID_Y:
        return f"{rows} rows are over the kernel's {MAX_GRID_Y}"

    def chunk_of(c: int) -> int:
        return ((-(-v // c)) + 7) & ~7

    if cluster is None:
        c = 1
        while c < MAX_CLUSTER and chunk_of(2 * c) >= THREADS and (
                topk_smem_bytes(chunk_of(c), c, k, element_size) > SMEM_TARGET or rows * c < num_sms):
            c *= 2
    elif cluster in (1, 2, 4, 8):
        c = cluster
    else:
        raise ValueError(f"cluster must be 1, 2, 4 or 8, got {cluster}")
    smem = topk_smem_bytes(chunk_of(c), c, k, element_size)
    if smem > max_smem:
        return (f"a row of {v} entries needs {smem} bytes of shared memory per CTA at a cluster of {c}; "
                f"the device allows {max_smem}")
    return c, chunk_of(c), smem


def _shape_reason(x: Tensor, k: int) -> str | None:
    if x.dtype not in DTYPE_CODE:
        return f"the logits are {x.dtype}; the kernel takes float32, bfloat16 or float16"
    if x.dim() < 1 or x.numel() == 0:
        return f"the logits have shape {tuple(x.shape)}: nothing to select from"
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return "the logits' last dimension is not contiguous"
    return None


def _checked_plan(x: Tensor, k: int, need_cuda: bool, cluster: int | None = None, num_sms: int | None = None,
                  max_smem: int | None = None) -> tuple[int, int, int] | str:
    """The launch plan of ``x``, ``k`` or why the kernel does not take them; ``need_cuda``: on this machine's
    CUDA device through the loader (``NOT_CUDA`` for CPU tensors), else any device (the CPU emulation runs
    the kernel on CPU tensors, planned for an H200 unless ``num_sms`` / ``max_smem`` say otherwise)."""
    reason = _shape_reason(x, k)
    if reason is None and need_cuda:
        reason = NOT_CUDA if not x.is_cuda else kernels_unavailable_reason(tensor_device_index(x))
    if reason is not None:
        return reason
    if x.is_cuda:
        num_sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
        max_smem = max_smem or device_smem_optin(tensor_device_index(x))
    rows = x.numel() // x.shape[-1]
    return launch_plan(rows, int(x.shape[-1]), k, x.element_size(), num_sms or 132, max_smem or 227 * 1024, cluster)


def topk_rows_unsupported_reason(x: Tensor, k: int) -> str | None:
    """None when ``topk_rows`` runs ``x``, ``k`` here, else why not (``NOT_CUDA`` for CPU tensors)."""
    plan = _checked_plan(x, k, need_cuda=True)
    return plan if isinstance(plan, str) else None


def _launch(x: Tensor, k: int, plan: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    c, chunk, smem = plan
    v = int(x.shape[-1])
    rows_shape = tuple(x.shape[:-1])
    x2 = x.reshape(-1, v)
    if x2.stride(-1) != 1 and v > 1:
        x2 = x2.contiguous()
    rows = int(x2.shape[0])
    values = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    es = x.element_size()
    row_stride = int(x2.stride(0)) if rows > 1 else v
    vec = int(x2.data_ptr() % 16 == 0 and (row_stride * es) % 16 == 0)
    kernel = get_kernel(SOURCE, "topk_rows", ["--std=c++17", "-lineinfo", f"-DTK_IN={DTYPE_CODE[x.dtype]}"],
                        tensor_device_index(x))
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    launch(kernel, (c, rows, 1), (THREADS, 1, 1),
           [x2, i64(row_stride), i32(v), i32(k), i32(_pow2_at_least(k)), i32(chunk), i32(vec), values, indices],
           shared_mem=smem, cluster=c)
    return values.reshape(*rows_shape, k), indices.reshape(*rows_shape, k)


def topk_rows(x: Tensor, k: int, cluster: int | None = None, num_sms: int | None = None,
              max_smem: int | None = None) -> tuple[Tensor, Tensor]:
    """The kernel: (values float32 [..., k], indices int64 [..., k]) as ``topk_rows_reference``.
    Raises ValueError for what it does not take (``_shape_reason``, ``launch_plan``); the device and the
    loader are not checked (``topk_rows_unsupported_reason`` does; the CPU emulation runs it on CPU
    tensors). ``cluster`` / ``num_sms`` / ``max_smem``: the launch plan's inputs, for tests."""
    plan = _checked_plan(x, k, need_cuda=False, cluster=cluster, num_sms=num_sms, max_smem=max_smem)
    if isinstance(plan, str):
        raise ValueError(f"topk_rows: {plan}")
    return _launch(x, k, plan)


def topk_candidates(logits: Tensor, k: int, kernel: bool = True) -> tuple[Tensor, Tensor]:
    """The DFlash candidates: (values float32, indices int64) of the ``k`` largest logits of every row
    (``min(k, V)`` of them). The kernel when ``kernel`` and it takes the input (one plan, checked once);
    else ``torch.topk`` of the float32 logits (float64 stays float64), the path before the kernel, with a
    one-time warning for CUDA inputs the kernel does not take."""
    k = min(k, int(logits.shape[-1]))
    if kernel and logits.dtype != torch.float64:
        plan = _checked_plan(logits, k, need_cuda=True)
        if not isinstance(plan, str):
            return _launch(logits, k, plan)
        if plan != NOT_CUDA and logits.is_cuda:
            warn_fallback("topk_rows", plan)
    x = logits if logits.dtype == torch.float64 else logits.float()
    return torch.topk(x, k, dim=-1)

"""The Weaver scorer's linear layers at a few rows, norm and epilogue fused (``cuda/weaver_linear.cu``).

``weaver_linear(x, weight, bias, residual, eps, swiglu)`` has the signature of
``weaver_linear_reference`` and computes the same function:

* ``h = rms_norm(x, eps)`` (``eps`` None: ``h = x``), ``z = h @ weight.T + bias``;
* ``swiglu``: ``silu(z[:, :N]) * z[:, N:]`` (weight ``[2 N, K]``: the gate rows, then the up rows);
  else ``z + residual`` (residual None: ``z``).

The reference rounds h and z to the activation dtype as torch does; the kernel keeps them in float32
and rounds once (the same function to bfloat16 rounding of the output). The kernel runs for CUDA
tensors of float32, bfloat16 or float16 (one dtype for all), at most ``KERNEL_ROWS`` rows of x (the
source takes up to ``MAX_ROWS``; from 8 rows its activation reads through L1 make it slower than
cuBLAS on the H200, ``bench/results/weaver_linear.json.gz``), K a
multiple of 8 and 16-byte aligned contiguous rows of x and weight; anything else (and
``VLLM_TFM_WEAVER_LINEAR_KERNEL=0``) calls the reference, with a one-time warning for CUDA inputs
the kernel does not take but for the row count (more rows: cuBLAS, silently).

The kernel is launched with programmatic dependent launch (``loader.launch(..., programmatic=True)``):
it loads its first weight columns and prefetches the rest of its rows into L2 while the previous
kernel of the stream still runs, and waits for it before reading x or the residual.
``VLLM_TFM_WEAVER_LINEAR_PDL=0`` compiles and launches it without (for A/B measurements).
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_tfm.kernels.loader import (
    aligned_rows,
    get_kernel,
    kernels_unavailable_reason,
    launch,
    tensor_device_index,
    warn_fallback,
)

__all__ = [
    "ENV_SWITCH",
    "KERNEL_ROWS",
    "MAX_ROWS",
    "NOT_CUDA",
    "PDL_SWITCH",
    "unsupported_reason",
    "weaver_linear",
    "weaver_linear_kernel",
    "weaver_linear_reference",
    "k_split",
]

SOURCE = "weaver_linear.cu"
WARPS = 4  # WL_WARPS in the source
SPLIT_TARGET_WARPS = 2048  # k_split's aim: about 16 warps per SM on the H200's 132, enough weight loads in flight
MAX_ROWS = 16  # WL_M <= 16: one output per lane in the epilogue
KERNEL_ROWS = 4  # the dispatch's limit: on the H200 cuBLAS is faster from 8 rows (bench/results/weaver_linear.json.gz)
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ENV_SWITCH = "VLLM_TFM_WEAVER_LINEAR_KERNEL"
PDL_SWITCH = "VLLM_TFM_WEAVER_LINEAR_PDL"
NOT_CUDA = "the tensors are not all on one CUDA device"
TOO_MANY_ROWS = "more rows than the kernel's"


def weaver_linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool
) -> Tensor:
    """x [M, K], weight [N', K], bias [N'] or None, residual [M, N'] or None (not with swiglu)."""
    if swiglu and residual is not None:
        raise ValueError("weaver_linear: SwiGLU takes no residual")
    h = F.rms_norm(x, (x.shape[-1],), eps=eps) if eps is not None else x
    if residual is not None:  # the residual add in the GEMM's epilogue, as the scorer's torch path
        z = torch.addmm(residual, h, weight.t()) if bias is None else torch.addmm(residual + bias, h, weight.t())
        return z
    z = F.linear(h, weight, bias)
    if swiglu:
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    return z


def unsupported_reason(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool
) -> str | None:
    """None when the kernel takes these inputs, else why not (host-side metadata only; the device
    is checked last, so CPU tensors the kernel would take give NOT_CUDA)."""
    tensors = [t for t in (x, weight, bias, residual) if t is not None]
    if x.dtype not in DTYPE_CODE or any(t.dtype != x.dtype for t in tensors):
        return f"dtypes {[str(t.dtype) for t in tensors]}: the kernel takes one of float32, bfloat16, float16 for all"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} are not [M, K] and [N, K]"
    if x.shape[0] > KERNEL_ROWS:
        return f"{x.shape[0]} rows: {TOO_MANY_ROWS} {KERNEL_ROWS} (cuBLAS is faster there)"
    if x.shape[1] % 8:
        return f"K = {x.shape[1]} is not a multiple of 8"
    if swiglu and (residual is not None or weight.shape[0] % 2):
        return "SwiGLU takes an even number of weight rows and no residual"
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias shape {tuple(bias.shape)} is not [{weight.shape[0]}]"
    if residual is not None and tuple(residual.shape) != (x.shape[0], n):
        return f"residual shape {tuple(residual.shape)} is not [{x.shape[0]}, {n}]"
    if not (aligned_rows(x) and aligned_rows(weight)):
        return "rows of x or weight are not contiguous and 16-byte aligned"
    if residual is not None and residual.stride(1) != 1:
        return "the residual's rows are not contiguous"
    if bias is not None and not bias.is_contiguous():
        return "the bias is not contiguous"
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        return NOT_CUDA
    return kernels_unavailable_reason(x.device.index)


def weaver_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool
) -> Tensor:
    """The fused layer through the kernel where it runs, else the reference (module docstring)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return weaver_linear_reference(x, weight, bias, residual, eps, swiglu)
    reason = unsupported_reason(x, weight, bias, residual, eps, swiglu)
    if reason is not None:
        if reason != NOT_CUDA and TOO_MANY_ROWS not in reason and x.is_cuda:
            warn_fallback("weaver_linear", reason)
        return weaver_linear_reference(x, weight, bias, residual, eps, swiglu)
    return weaver_linear_kernel(x, weight, bias, residual, eps, swiglu)


def k_split(units: int, k: int) -> int:
    """Warps sharing one unit's K (1, 2 or 4; WL_KSPLIT): layers with few output rows and a long K
    (the 27B Weaver's token_in 5120 -> 1024, down 3072 -> 1024, o_proj) have too few warps to keep
    enough weight loads in flight, one group of 4 steps of 256 columns each at a time. Doubled while
    units x split < SPLIT_TARGET_WARPS and every warp keeps >= 1 step of 256 columns."""
    steps = -(-k // 256)
    split = 1
    while split < 4 and units * split < SPLIT_TARGET_WARPS and 2 * split <= steps:
        split *= 2
    return split


def weaver_linear_kernel(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool
) -> Tensor:
    """The launch itself, for inputs ``unsupported_reason`` accepts (not checked again)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    units = n if swiglu else (n + 1) // 2
    pdl = os.environ.get(PDL_SWITCH, "1") != "0"
    split = k_split(units, k)
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[x.dtype]}", f"-DWL_M={m}",
            f"-DWL_MODE={1 if swiglu else 0}", f"-DWL_NORM={0 if eps is None else 1}", f"-DWL_PDL={int(pdl)}",
            f"-DWL_KSPLIT={split}"]
    kernel = get_kernel(SOURCE, "weaver_linear", opts, tensor_device_index(x))
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    launch(
        kernel,
        (-(-units * split // WARPS), 1, 1),
        (WARPS * 32, 1, 1),
        [x, i64(x.stride(0)), weight, i64(weight.stride(0)), bias, residual,
         i64(residual.stride(0) if residual is not None else 0), y, i64(y.stride(0)), i32(n), i32(k),
         ctypes.c_float(0.0 if eps is None else eps)],
        programmatic=pdl,
    )
    return y

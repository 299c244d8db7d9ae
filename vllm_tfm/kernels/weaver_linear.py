"""The Weaver scorer's linear layers at a few rows, norm and epilogue fused (``cuda/weaver_linear.cu``).

``weaver_linear(x, weight, bias, residual, eps, swiglu, weight_scale=None, rows=None)`` has the
signature of ``weaver_linear_reference`` and computes the same function:

* ``rows`` (int64 [M]): the layer's input is ``x[rows.clamp(0, len(x) - 1)]`` (x a table, such as the
  target's input embedding: the gather and the clamp of invalid ids fused into the layer);
* ``weight_scale`` (float32 [N']): ``weight`` is float8 e4m3 with one scale per row (weight-only FP8,
  ``quantize_weight_rows``), its values ``weight.float() * weight_scale[:, None]``;
* ``h = rms_norm(x, eps)`` (``eps`` None: ``h = x``), ``z = h @ weight.T + bias``;
* ``swiglu``: ``silu(z[:, :N]) * z[:, N:]`` (weight ``[2 N, K]``: the gate rows, then the up rows);
  else ``z + residual`` (residual None: ``z``).

The reference rounds h and z to the activation dtype as torch does; the kernel keeps them in float32
and rounds once (the same function to bfloat16 rounding of the output). The kernel runs for CUDA
tensors of float32, bfloat16 or float16 (one dtype for all but an FP8 weight), at most ``KERNEL_ROWS``
rows of x with 16-bit or float32 weights (the source takes up to ``MAX_ROWS``; from 8 rows its activation
reads through L1 make it slower than cuBLAS on the H200, ``bench/results/weaver_linear.json.gz``) and
``FP8_KERNEL_ROWS`` with FP8 weights (no cuBLAS path reads those), K a
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
    "FP8_KERNEL_ROWS",
    "KERNEL_ROWS",
    "MAX_ROWS",
    "NOT_CUDA",
    "PDL_SWITCH",
    "unsupported_reason",
    "weaver_linear",
    "weaver_linear_kernel",
    "weaver_linear_reference",
    "k_split",
    "quantize_weight_rows",
]

SOURCE = "weaver_linear.cu"
WARPS = 4  # WL_WARPS in the source
SPLIT_TARGET_WARPS = 2048  # k_split's aim: about 16 warps per SM on the H200's 132, enough weight loads in flight
MAX_ROWS = 16  # WL_M <= 16: one output per lane in the epilogue
KERNEL_ROWS = 4  # the dispatch's limit: on the H200 cuBLAS is faster from 8 rows (bench/results/weaver_linear.json.gz)
FP8_KERNEL_ROWS = 4  # with FP8 weights: a round's 14 layers 75.7 -> 56.8 us at 2 rows, no gain at 4, and from 8 rows
# cuBLAS on bfloat16 is faster (H100, bench/results/weaver_linear_fp8_s66.json.gz); callers keep the dequantized
# values for cuBLAS above it (BatchedWeaverTreeScorer)
FP8 = torch.float8_e4m3fn
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ENV_SWITCH = "VLLM_TFM_WEAVER_LINEAR_KERNEL"
PDL_SWITCH = "VLLM_TFM_WEAVER_LINEAR_PDL"
NOT_CUDA = "the tensors are not all on one CUDA device"
TOO_MANY_ROWS = "more rows than the kernel's"


def quantize_weight_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] float weight -> (float8_e4m3fn [N, K], float32 [N]): one scale per row, ``amax / 448``, for
    ``weaver_linear``'s weight-only FP8 path: the FP8 lm_head copy's rounding (``fp8_head.quantize_head``, whose
    padding rows are dropped). Done once per weight."""
    from vllm_tfm.kernels.fp8_head import quantize_head

    if weight.dim() != 2:
        raise ValueError(f"quantize_weight_rows: the weight must be [N, K], got {tuple(weight.shape)}")
    n = weight.shape[0]
    q, scale = quantize_head(weight)
    return q[:n], scale[0, :n].contiguous()


def dequantize_weight_rows(weight: Tensor, weight_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The values of an FP8 weight with row scales, rounded once to ``dtype``."""
    return (weight.float() * weight_scale.float()[:, None]).to(dtype)


def _check_args(x: Tensor, weight: Tensor, weight_scale: Tensor | None, rows: Tensor | None) -> None:
    if rows is not None and rows.numel() and x.shape[0] == 0:
        raise ValueError("weaver_linear: rows index an empty table x")
    if (weight.dtype == FP8) != (weight_scale is not None):
        raise ValueError("weaver_linear: a float8_e4m3fn weight comes with weight_scale (float32, one per row), "
                         f"and only it; got weight {weight.dtype}, weight_scale "
                         f"{None if weight_scale is None else weight_scale.dtype}")
    if weight_scale is not None and (weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (weight.shape[0],)):
        raise ValueError(f"weaver_linear: weight_scale must be float32 [{weight.shape[0]}], got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")


def weaver_linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool,
    weight_scale: Tensor | None = None, rows: Tensor | None = None,
) -> Tensor:
    """x [M, K] (or a table [T, K] with rows [M]), weight [N', K], bias [N'] or None, residual [M, N'] or None
    (not with swiglu); weight_scale [N'] with a float8_e4m3fn weight (computed as its values rounded to x's dtype)."""
    if swiglu and residual is not None:
        raise ValueError("weaver_linear: SwiGLU takes no residual")
    _check_args(x, weight, weight_scale, rows)
    if rows is not None:
        x = x[rows.clamp(0, x.shape[0] - 1)]
    if weight_scale is not None:
        weight = dequantize_weight_rows(weight, weight_scale, x.dtype)
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
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool,
    weight_scale: Tensor | None = None, rows: Tensor | None = None,
) -> str | None:
    """None when the kernel takes these inputs, else why not (host-side metadata only; the device
    is checked last, so CPU tensors the kernel would take give NOT_CUDA)."""
    _check_args(x, weight, weight_scale, rows)
    fp8 = weight_scale is not None
    tensors = [t for t in (x, bias, residual) if t is not None] + ([] if fp8 else [weight])
    if x.dtype not in DTYPE_CODE or any(t.dtype != x.dtype for t in tensors):
        return (f"dtypes {[str(t.dtype) for t in tensors]}: the kernel takes one of float32, bfloat16, float16 for "
                "all (the weight may be float8_e4m3fn with row scales)")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} are not [M, K] and [N, K]"
    if rows is not None and (rows.dtype != torch.long or rows.dim() != 1 or not rows.is_contiguous()):
        return f"rows must be contiguous int64 [M], got {rows.dtype} {tuple(rows.shape)}"
    m = x.shape[0] if rows is None else rows.shape[0]
    limit = FP8_KERNEL_ROWS if fp8 else KERNEL_ROWS
    if m > limit:
        return f"{m} rows: {TOO_MANY_ROWS} {limit}" + ("" if fp8 else " (cuBLAS is faster there)")
    if x.shape[1] % 8:
        return f"K = {x.shape[1]} is not a multiple of 8"
    if swiglu and (residual is not None or weight.shape[0] % 2):
        return "SwiGLU takes an even number of weight rows and no residual"
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias shape {tuple(bias.shape)} is not [{weight.shape[0]}]"
    if residual is not None and tuple(residual.shape) != (m, n):
        return f"residual shape {tuple(residual.shape)} is not [{m}, {n}]"
    if fp8 and x.shape[1] % 16:
        return f"K = {x.shape[1]} is not a multiple of 16 (an FP8 weight: 16 columns per lane and load)"
    if not (aligned_rows(x) and aligned_rows(weight)):
        return "rows of x or weight are not contiguous and 16-byte aligned"
    if residual is not None and residual.stride(1) != 1:
        return "the residual's rows are not contiguous"
    if bias is not None and not bias.is_contiguous():
        return "the bias is not contiguous"
    if fp8 and not weight_scale.is_contiguous():
        return "the weight scales are not contiguous"
    tensors += [t for t in (weight, weight_scale, rows) if t is not None]
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        return NOT_CUDA
    return kernels_unavailable_reason(x.device.index)


def weaver_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool,
    weight_scale: Tensor | None = None, rows: Tensor | None = None,
) -> Tensor:
    """The fused layer through the kernel where it runs, else the reference (module docstring)."""
    args = (x, weight, bias, residual, eps, swiglu, weight_scale, rows)
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return weaver_linear_reference(*args)
    reason = unsupported_reason(*args)
    if reason is not None:
        if reason != NOT_CUDA and TOO_MANY_ROWS not in reason and x.is_cuda:
            warn_fallback("weaver_linear", reason)
        return weaver_linear_reference(*args)
    return weaver_linear_kernel(*args)


def k_split(units: int, k: int, step: int = 256) -> int:
    """Warps sharing one unit's K (1, 2 or 4; WL_KSPLIT): layers with few output rows and a long K
    (the 27B Weaver's token_in 5120 -> 1024, down 3072 -> 1024, o_proj) have too few warps to keep
    enough weight loads in flight, one group of 4 steps of ``step`` columns each at a time (256; 512
    with FP8 weights). Doubled while units x split < SPLIT_TARGET_WARPS and every warp keeps >= 1 step."""
    steps = -(-k // step)
    split = 1
    while split < 4 and units * split < SPLIT_TARGET_WARPS and 2 * split <= steps:
        split *= 2
    return split


def weaver_linear_kernel(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float | None, swiglu: bool,
    weight_scale: Tensor | None = None, rows: Tensor | None = None,
) -> Tensor:
    """The launch itself, for inputs ``unsupported_reason`` accepts (not checked again)."""
    k = x.shape[1]
    m = x.shape[0] if rows is None else rows.shape[0]
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    units = n if swiglu else (n + 1) // 2
    pdl = os.environ.get(PDL_SWITCH, "1") != "0"
    split = k_split(units, k, 512 if weight_scale is not None else 256)
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[x.dtype]}", f"-DWL_M={m}",
            f"-DWL_MODE={1 if swiglu else 0}", f"-DWL_NORM={0 if eps is None else 1}", f"-DWL_PDL={int(pdl)}",
            f"-DWL_KSPLIT={split}", f"-DWL_W8={int(weight_scale is not None)}"]
    kernel = get_kernel(SOURCE, "weaver_linear", opts, tensor_device_index(x))
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    launch(
        kernel,
        (-(-units * split // WARPS), 1, 1),
        (WARPS * 32, 1, 1),
        [x, i64(x.stride(0)), weight, i64(weight.stride(0)), bias, residual,
         i64(residual.stride(0) if residual is not None else 0), y, i64(y.stride(0)), i32(n), i32(k),
         ctypes.c_float(0.0 if eps is None else eps), weight_scale, rows, i64(x.shape[0])],
        programmatic=pdl,
    )
    return y

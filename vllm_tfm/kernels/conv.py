"""Torch-facing wrappers of the tree conv1d kernels (``cuda/tree_conv.cu``).

``tree_causal_conv1d`` and ``tree_conv_commit`` have exactly the signatures of the torch reference
in ``vllm_tfm.verify.conv`` and compute the same function. CUDA kernels run for CUDA tensors of
float32, bfloat16 or float16 with a conv width of at most 8; anything else calls the reference
(with a one-time warning for CUDA inputs).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_tfm.kernels.gdn import DTYPE_CODE, NOT_CUDA, _check_out
from vllm_tfm.kernels.loader import get_kernel, kernels_unavailable_reason, launch, tensor_device_index, warn_fallback
from vllm_tfm.kernels.plan import CommitIndices, TreePlan

__all__ = [
    "ConvExtras",
    "conv_unsupported_reason",
    "extras_unsupported_reason",
    "tree_causal_conv1d",
    "tree_causal_conv1d_planned",
    "tree_conv_commit",
    "tree_conv_commit_planned",
    "unrolled_enabled",
]

SOURCE = "tree_conv.cu"
THREADS = 256
NODES_PER_CTA = 8
MAX_WIDTH = 8
UNROLLED_SWITCH = "VLLM_TFM_TREE_CONV_UNROLLED"


def unrolled_enabled() -> bool:
    """``VLLM_TFM_TREE_CONV_UNROLLED`` unset or not ``0`` (read at every launch; on by default since bench/NOTES.md
    section 71): ``tree_conv1d`` compiled with the conv width as a constant (``-DCONV_W``), the loads of a CTA's
    windows unrolled and all in flight before the first use, instead of one memory round trip per window entry
    (H200, n = 16, batch 1: 10.4 -> 6.8 us; ``bench/results/tree_conv_unrolled_s71.json.gz``). Where x and the
    conv state differ in dtype the loop build runs either way. The same arithmetic in the same order (the same
    results bit for bit)."""
    return os.environ.get(UNROLLED_SWITCH, "1") != "0"


def _options(x: Tensor, state: Tensor, weight: Tensor | None) -> list[str]:
    wt = DTYPE_CODE[weight.dtype] if weight is not None else 0
    return ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[x.dtype]}", f"-DCONV_ST={DTYPE_CODE[state.dtype]}", f"-DCONV_WT={wt}"]


def _unsupported(x: Tensor, conv_state: Tensor, width: int, *others: Tensor | None) -> str | None:
    tensors = [x, conv_state, *[t for t in others if t is not None]]
    if not all(t.is_cuda for t in tensors):
        return NOT_CUDA
    if any(t.dtype not in DTYPE_CODE for t in tensors):
        return f"dtypes {[str(t.dtype) for t in tensors]}: the kernel takes float32, bfloat16 or float16"
    if x.dim() != 2 or conv_state.dim() != 3:
        return "shapes are not x [T, D] / conv_state [slots, D, L]"
    if not 1 <= width <= MAX_WIDTH:
        return f"conv width {width} is outside the kernel's 1..{MAX_WIDTH}"
    return kernels_unavailable_reason(x.device.index)


def conv_unsupported_reason(x: Tensor, conv_state: Tensor, width: int, *others: Tensor | None) -> str | None:
    """None when the conv kernels take these tensors (dtypes, shapes, width, device), else why not.

    Host-side checks of tensor metadata only (no device synchronisation), for callers of the
    ``*_planned`` variants that validated the tree once per step themselves.
    """
    return _unsupported(x, conv_state, width, *others)



@dataclass(frozen=True)
class ConvExtras:
    """Work the tree conv launch does besides y (each part optional; ``cuda/tree_conv.cu``), so that a GDN
    layer's prologue is one launch instead of a copy of x, a copy of q and k and the gates' five ops.

    qk_out: [2, T, qk_cols] in x.dtype, each half contiguous: channels 0 .. 2 qk_cols - 1 of y (q, then k)
    go there instead of y (whose first 2 qk_cols columns are then left unwritten).
    x_copy: [T, D] in x.dtype, rows contiguous: a copy of x.
    gates: (a, b, neg_exp_a, dt_bias, g_out, beta_out): a, b [T, HV] in x.dtype (rows of any stride);
    neg_exp_a, dt_bias [HV] float32 (``vllm_tfm.verify.gdn.gate_constants``); g_out, beta_out [T, HV]
    float32 (rows of any stride), written with ``gdn_gates``' values.
    """

    qk_out: Tensor | None = None
    qk_cols: int = 0
    x_copy: Tensor | None = None
    gates: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor] | None = None


def extras_unsupported_reason(x: Tensor, extras: ConvExtras) -> str | None:
    """None when the conv launch can do ``extras`` for x [T, D], else why not (host checks only)."""
    t, d = x.shape
    if extras.qk_out is not None:
        q = extras.qk_out
        if q.dtype != x.dtype or q.dim() != 3 or q.shape[0] != 2 or q.shape[1] != t or q.shape[2] != extras.qk_cols:
            return f"qk_out must be [2, {t}, qk_cols] in {x.dtype}, got {tuple(q.shape)} {q.dtype}"
        if q.stride(2) != 1 or q.stride(1) != extras.qk_cols or not 0 < 2 * extras.qk_cols <= d:
            return "qk_out halves must be contiguous and 2 qk_cols <= D"
    if extras.x_copy is not None:
        c = extras.x_copy
        if c.dtype != x.dtype or c.shape != x.shape or c.stride(1) != 1:
            return f"x_copy must be [{t}, {d}] in {x.dtype} with contiguous rows"
    if extras.gates is not None:
        a, b, nea, dtb, g, beta = extras.gates
        if a.dtype != x.dtype or b.dtype != x.dtype:
            return f"gate inputs a, b must be in {x.dtype}, got {a.dtype}, {b.dtype}"
        hv = a.shape[-1]
        for name, tt in (("a", a), ("b", b), ("g_out", g), ("beta_out", beta)):
            if tt.dim() != 2 or tt.shape != (t, hv) or tt.stride(1) != 1:
                return f"{name} must be [{t}, {hv}] with contiguous rows, got {tuple(tt.shape)}"
        if g.dtype != torch.float32 or beta.dtype != torch.float32:
            return "g_out and beta_out must be float32"
        if nea.shape != (hv,) or dtb.shape != (hv,) or nea.dtype != torch.float32 or dtb.dtype != torch.float32:
            return "neg_exp_a and dt_bias must be float32 [HV]"
        if not (nea.is_contiguous() and dtb.is_contiguous()):
            return "neg_exp_a and dt_bias must be contiguous"
    return None


def tree_causal_conv1d_planned(
    plan: TreePlan,
    x: Tensor,
    conv_state: Tensor,
    state_indices: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = "silu",
    window_start: Tensor | None = None,
    out: Tensor | None = None,
    extras: ConvExtras | None = None,
) -> Tensor:
    """CUDA tree conv1d for a prebuilt plan; shapes and result as ``vllm_tfm.verify.conv.tree_causal_conv1d``.

    out: optional contiguous preallocated output [T, D] in x.dtype, written in full (but for the
    columns that ``extras.qk_out`` takes).
    extras: more outputs of the same launch (:class:`ConvExtras`; must pass :func:`extras_unsupported_reason`).
    """
    t_nodes, dim = x.shape
    width = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    dev = x.device
    y = _check_out(out, (t_nodes, dim), x.dtype, dev, "out")
    ex = extras or ConvExtras()
    qk, xc, gates = ex.qk_out, ex.x_copy, ex.gates
    a = b = nea = dtb = g = beta = None
    if gates is not None:
        a, b, nea, dtb, g, beta = gates
    sidx = state_indices.to(device=dev, dtype=torch.int32).contiguous()
    wst = None if window_start is None else window_start.to(device=dev, dtype=torch.int32).contiguous()
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    options = _options(x, conv_state, weight)
    if unrolled_enabled() and x.dtype == conv_state.dtype:  # the width compiled in: the CTA's loads all in flight
        options.append(f"-DCONV_W={width}")
    kern = get_kernel(SOURCE, "tree_conv1d", options, tensor_device_index(x))
    cs, ws = conv_state.stride(), weight.stride()
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    launch(
        kern,
        ((dim + THREADS - 1) // THREADS, (t_nodes + NODES_PER_CTA - 1) // NODES_PER_CTA, 1),
        (THREADS, 1, 1),
        [x, i64(x.stride(0)), plan.req_of, plan.cu, plan.pos, plan.depth, plan.pair_off, plan.pair_j,
         conv_state, i64(cs[0]), i64(cs[1]), i64(cs[2]), sidx, wst,
         weight, i64(ws[0]), i64(ws[1]), bias, i64(bias.stride(0) if bias is not None else 0),
         y, i32(t_nodes), i32(dim), i32(width), i32(int(activation == "silu")),
         qk, i64(qk.stride(0) if qk is not None else 0), i32(ex.qk_cols if qk is not None else 0),
         xc, i64(xc.stride(0) if xc is not None else 0),
         a, i64(a.stride(0) if a is not None else 0), b, i64(b.stride(0) if b is not None else 0), nea, dtb,
         g, i64(g.stride(0) if g is not None else 0), beta, i64(beta.stride(0) if beta is not None else 0),
         i32(a.shape[1] if a is not None else 0)],
    )
    return y


def tree_causal_conv1d(
    x: Tensor,
    parents: Tensor,
    cu_nodes: Tensor,
    conv_state: Tensor,
    state_indices: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = "silu",
    window_start: Tensor | None = None,
) -> Tensor:
    """Depthwise causal conv over every node's root..node path; conv_state is not written.

    Same signature and result as ``vllm_tfm.verify.conv.tree_causal_conv1d``: x [T, D];
    parents [T] local; cu_nodes [R+1]; conv_state [slots, D, L]; state_indices [R];
    weight [D, W]; bias [D] or None; activation "silu" or None; window_start [R] or None.
    Returns [T, D] in x.dtype. CUDA kernel when supported, else the torch reference.
    """
    from vllm_tfm.verify import conv as reference

    width = weight.shape[-1] if weight.dim() == 2 else 0
    reason = _unsupported(x, conv_state, width, weight, bias)
    if reason is not None:
        if reason != NOT_CUDA:
            warn_fallback("tree_causal_conv1d", reason)
        return reference.tree_causal_conv1d(
            x, parents, cu_nodes, conv_state, state_indices, weight, bias, activation, window_start
        )
    _validate_conv(x, parents, cu_nodes, conv_state, state_indices, weight, bias, activation, window_start)
    plan = TreePlan.build(parents, cu_nodes, device=x.device)
    return tree_causal_conv1d_planned(plan, x, conv_state, state_indices, weight, bias, activation, window_start)


def _check_window(starts: list[int], width: int, state_len: int, name: str) -> None:
    for r, s in enumerate(starts):
        if s < 0 or s + width - 1 > state_len:
            raise ValueError(
                f"{name}[{r}] = {s}: the committed window (columns {s}..{s + width - 2}) "
                f"does not fit in a conv state of {state_len} columns"
            )


def _validate_conv(x, parents, cu_nodes, conv_state, state_indices, weight, bias, activation, window_start) -> None:
    """The reference's argument checks (same messages), without its math."""
    from vllm_tfm.verify.ragged_trees import check_per_request, check_slot_indices, request_bounds

    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    tokens, dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [D={dim}, W], got {tuple(weight.shape)}")
    width = weight.shape[1]
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must have shape [D={dim}], got {tuple(bias.shape)}")
    if conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ValueError(
            f"conv_state must have shape [num_slots, D={dim}, L >= {width - 1}], got {tuple(conv_state.shape)}"
        )
    bounds = request_bounds(parents, cu_nodes, tokens)
    check_slot_indices(state_indices, len(bounds), conv_state.shape[0], "state_indices")
    _check_window(check_per_request(window_start, len(bounds), "window_start"), width, conv_state.shape[2], "window_start")


def tree_conv_commit_planned(
    plan: TreePlan,
    x: Tensor,
    idx: CommitIndices,
    conv_state: Tensor,
    width: int,
) -> None:
    """CUDA conv commit for a prebuilt plan and commit indices (no host synchronisation; graph-capturable).

    x [T, D]; conv_state [slots, D, L], written in place at ``idx.dst`` columns
    ``idx.dst_start .. + width - 2``.
    """
    if width <= 1:
        return  # nothing is kept
    if x.stride(1) != 1:
        x = x.contiguous()
    src_state = conv_state if idx.snapshot is None else conv_state[idx.snapshot].contiguous()
    kern = get_kernel(SOURCE, "tree_conv_commit", _options(x, conv_state, None), tensor_device_index(x))
    ss, ds = src_state.stride(), conv_state.stride()
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    dim = x.shape[1]
    launch(
        kern,
        ((dim + THREADS - 1) // THREADS, plan.num_requests, 1),
        (THREADS, 1, 1),
        [x, i64(x.stride(0)), plan.cu, plan.pos, plan.depth, plan.pair_off, plan.pair_j, idx.accepted,
         src_state, idx.src, i64(ss[0]), i64(ss[1]), i64(ss[2]), idx.src_start,
         conv_state, idx.dst, i64(ds[0]), i64(ds[1]), i64(ds[2]), idx.dst_start, i32(dim), i32(width)],
    )


def tree_conv_commit(
    x: Tensor,
    parents: Tensor,
    cu_nodes: Tensor,
    accepted: Tensor,
    conv_state: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    width: int,
    src_start: Tensor | None = None,
    dst_start: Tensor | None = None,
) -> None:
    """Advance each request's conv window along its accepted path, in place.

    Same signature and semantics as ``vllm_tfm.verify.conv.tree_conv_commit``: x [T, D];
    parents [T] local; cu_nodes [R+1]; accepted [R]; conv_state [slots, D, L]; src_indices,
    dst_indices [R] (dst distinct); width W; src_start, dst_start [R] or None.
    CUDA kernel when supported, else the torch reference.
    """
    from vllm_tfm.verify import conv as reference

    reason = _unsupported(x, conv_state, width)
    if reason is not None:
        if reason != NOT_CUDA:
            warn_fallback("tree_conv_commit", reason)
        reference.tree_conv_commit(
            x, parents, cu_nodes, accepted, conv_state, src_indices, dst_indices, width, src_start, dst_start
        )
        return
    acc, src, dst, s_starts, d_starts = _checked_commit_args(
        x, parents, cu_nodes, accepted, conv_state, src_indices, dst_indices, width, src_start, dst_start
    )
    plan = TreePlan.build(parents, cu_nodes, device=x.device)
    idx = CommitIndices.build(acc, src, dst, x.device, s_starts, d_starts)
    tree_conv_commit_planned(plan, x, idx, conv_state, width)


def _checked_commit_args(
    x: Tensor, parents: Tensor, cu_nodes: Tensor, accepted: Tensor, conv_state: Tensor, src_indices: Tensor,
    dst_indices: Tensor, width: int, src_start: Tensor | None, dst_start: Tensor | None,
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The reference's checks of a conv commit's arguments (host copies): (accepted, src, dst, src_start, dst_start)."""
    from vllm_tfm.verify.ragged_trees import check_per_request, check_slot_indices, request_bounds

    tokens, dim = x.shape
    if conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ValueError(
            f"conv_state must have shape [num_slots, D={dim}, L >= {width - 1}], got {tuple(conv_state.shape)}"
        )
    bounds = request_bounds(parents, cu_nodes, tokens)
    nreq = len(bounds)
    src = check_slot_indices(src_indices, nreq, conv_state.shape[0], "src_indices")
    dst = check_slot_indices(dst_indices, nreq, conv_state.shape[0], "dst_indices", distinct=True)
    acc = check_per_request(accepted, nreq, "accepted")
    s_starts = check_per_request(src_start, nreq, "src_start")
    d_starts = check_per_request(dst_start, nreq, "dst_start")
    _check_window(s_starts, width, conv_state.shape[2], "src_start")
    _check_window(d_starts, width, conv_state.shape[2], "dst_start")
    for r, ((s, e), a) in enumerate(zip(bounds, acc)):
        if not 0 <= a < e - s:
            raise ValueError(f"accepted[{r}] = {a} is not a node of request {r} (it has {e - s} nodes)")
    return acc, src, dst, s_starts, d_starts

"""The Weaver scorer's block stack for one growth round in one cooperative launch (``cuda/weaver_stack.cu``).

``weaver_stack(emb, weights, rope, node_ids, parent_ids, depths, valid, kv_cache, key_bias, p0, scale)``
has the signature of ``weaver_stack_reference`` and computes the same function: the token input
projection, every Weaver layer (qkv with RoPE rows, node attention with its K/V and key-mask writes,
o_proj, SwiGLU MLP, residuals) and the query projection, norms folded in
(``vllm_tfm.models.weaver_step``); it returns the queries ``[R w, n_q]``. The reference is the scorer's
per-op path: ``weaver_linear_reference`` and ``node_attention_reference`` in the scorer's order.

The kernel does what the per-op kernels do (``weaver_linear.cu`` with one warp per unit, and
``weaver_attention.cuh``), bit for bit, in one launch of one block per SM with grid barriers between
the stages, streaming every stage's weights into shared memory ahead of time (the source's header
says how). It is off unless ``VLLM_TFM_WEAVER_STACK=1`` (not yet timed on a GPU; bench/NOTES.md
section 52). It runs for CUDA tensors of one dtype (float32, bfloat16 or float16), at most
``MAX_ROWS`` rows R w, 1-4 layers of one head shape, contiguous weights with K a multiple of 8 and
what the node attention kernel takes; anything else calls the reference (the scorer falls back to its
per-op kernels), with a one-time warning for CUDA inputs the kernel does not take.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_tfm.kernels import weaver_attention as attention
from vllm_tfm.kernels.loader import (
    KernelStruct,
    device_smem_optin,
    get_kernel,
    kernels_unavailable_reason,
    launch,
    tensor_device_index,
    warn_fallback,
)
from vllm_tfm.kernels.weaver_linear import weaver_linear_reference

__all__ = [
    "ENV_SWITCH",
    "MAX_LAYERS",
    "MAX_ROWS",
    "NOT_CUDA",
    "StackLayer",
    "StackWeights",
    "grid_size",
    "per_op_stack",
    "set_stack",
    "stack_enabled",
    "stack_smem_bytes",
    "timeline_stages",
    "unsupported_reason",
    "weaver_stack",
    "weaver_stack_kernel",
    "weaver_stack_reference",
]

SOURCE = "weaver_stack.cu"
THREADS = 256  # WS_THREADS in the source
WARPS = THREADS // 32
PIECES = 8  # WS_PIECES: 16-byte pieces per lane and chunk
MAX_ROWS = 16  # WS_M <= 16
MAX_LAYERS = 4  # WS_MAX_LAYERS
MAX_SLOTS = 6  # chunk slots per warp the wrapper asks for at most (2..8 in the source)
MAX_SYNCS = 32  # WS_MAX_SYNCS: stage counters after the grid barrier's state in the scratch (WS_SYNC 1)
LIN_BYTES = 64  # sizeof(WSLin) in the source
ALIGN = 128  # bytes: every scratch buffer starts on its own cache line (the source's "Memory ordering")
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ENV_SWITCH = "VLLM_TFM_WEAVER_STACK"
NOT_CUDA = "the tensors are not all on one CUDA device"


@dataclass(frozen=True)
class StackLayer:
    """One Weaver layer's folded weights, each ``[N, K]`` row-major (the scorer's ``[K, N]`` views
    transposed back): qkv with its rotate_half rows, o_proj, gate and up rows, down."""

    qkv_w: Tensor
    qkv_b: Tensor
    attn_eps: float
    o_w: Tensor
    gu_w: Tensor
    gu_b: Tensor
    mlp_eps: float
    down_w: Tensor


@dataclass(frozen=True)
class StackWeights:
    """The token input projection, the layers and the query projection (``[N, K]`` weights)."""

    tok_w: Tensor
    tok_b: Tensor
    tok_eps: float
    layers: tuple[StackLayer, ...]
    qry_w: Tensor
    qry_b: Tensor
    qry_eps: float


_override: list[bool | None] = [None]  # set_stack's setting in this process (None: the environment's)


def stack_enabled() -> bool:
    """``VLLM_TFM_WEAVER_STACK=1`` (default off), unless ``set_stack`` overrode it: the scorer runs its
    stack through this kernel where it runs."""
    on = _override[0]
    return os.environ.get(ENV_SWITCH, "0") == "1" if on is None else on


def set_stack(on: bool | None) -> bool:
    """Override ``VLLM_TFM_WEAVER_STACK`` in this process (None: back to the environment's); the setting
    now in force. The runtime's Weaver CUDA graphs key on it."""
    _override[0] = on
    return stack_enabled()


def per_op_stack(
    linear: Callable[..., Tensor], node_attention: Callable[..., Tensor], emb: Tensor, weights: StackWeights,
    rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor, valid: Tensor, kv_cache: list[Tensor],
    key_bias: Tensor, p0: int, scale: float,
) -> Tensor:
    """The stack one layer at a time, in the scorer's order: ``linear`` with ``weaver_linear``'s signature
    and ``node_attention`` with ``node_attention``'s (their references here; their dispatching kernels in
    bench/weaver_stack.py's per-op arm)."""
    x = linear(emb, weights.tok_w, weights.tok_b, None, weights.tok_eps, False)
    for li, (lw, kv) in enumerate(zip(weights.layers, kv_cache)):
        proj = linear(x, lw.qkv_w, lw.qkv_b, None, lw.attn_eps, False)
        attn = node_attention(proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias, p0, scale, li == 0)
        x = linear(attn, lw.o_w, None, x, None, False)
        h = linear(x, lw.gu_w, lw.gu_b, None, lw.mlp_eps, True)
        x = linear(h, lw.down_w, None, x, None, False)
    return linear(x, weights.qry_w, weights.qry_b, None, weights.qry_eps, False)


def weaver_stack_reference(
    emb: Tensor, weights: StackWeights, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor,
    valid: Tensor, kv_cache: list[Tensor], key_bias: Tensor, p0: int, scale: float,
) -> Tensor:
    """emb [M, hidden] -> queries [M, n_q]; writes the nodes' K/V into ``kv_cache[l]`` and, at the first
    layer, their key-mask rows into ``key_bias`` (``node_attention_reference``'s contract)."""
    return per_op_stack(weaver_linear_reference, attention.node_attention_reference, emb, weights, rope, node_ids,
                        parent_ids, depths, valid, kv_cache, key_bias, p0, scale)


def stack_smem_bytes(slots: int, layers: int, w: int, span: int, hd: int, elem: int) -> int:
    """Dynamic shared memory of one launch (the source's layout): the warps' chunk rings, the linear
    stages' descriptors, the norms' partial sums, the attention's staging."""
    ring = WARPS * slots * PIECES * 32 * 16
    lin = -(-(2 + 4 * layers) * LIN_BYTES // 16) * 16
    return ring + lin + 64 * 4 + attention.attention_smem_bytes(w, span, hd, elem)


def _slots(layers: int, w: int, span: int, hd: int, elem: int, limit: int) -> int:
    """The most chunk slots per warp (<= MAX_SLOTS) whose shared memory fits ``limit``; 0 if not even 2."""
    for slots in range(MAX_SLOTS, 1, -1):
        if stack_smem_bytes(slots, layers, w, span, hd, elem) <= limit:
            return slots
    return 0


def grid_size(device_index: int) -> int:
    """Blocks of a launch: one per SM (each block takes most of an SM's shared memory, so one is
    resident per SM and the cooperative launch holds them all)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _weight_list(weights: StackWeights) -> list[Tensor]:
    out = [weights.tok_w, weights.tok_b, weights.qry_w, weights.qry_b]
    for lw in weights.layers:
        out += [lw.qkv_w, lw.qkv_b, lw.o_w, lw.gu_w, lw.gu_b, lw.down_w]
    return out


def _shape_reason(emb: Tensor, weights: StackWeights, kv_cache: list[Tensor]) -> str | None:
    """Why the weights, kv caches and emb do not form one stack the kernel takes (None: they do)."""
    layers = weights.layers
    if not 1 <= len(layers) <= MAX_LAYERS or len(kv_cache) != len(layers):
        return f"{len(layers)} layers and {len(kv_cache)} K/V caches: the kernel takes 1..{MAX_LAYERS} layers, one cache each"
    if emb.dim() != 2 or weights.tok_w.dim() != 2:
        return f"emb {tuple(emb.shape)} and tok_w {tuple(weights.tok_w.shape)} are not [M, hidden] and [d, hidden]"
    m, hidden = emb.shape
    d = weights.tok_w.shape[0]
    if kv_cache[0].dim() != 5:
        return f"kv_cache[0] {tuple(kv_cache[0].shape)} is not [2, R, heads, S, hd]"
    heads, hd = kv_cache[0].shape[2], kv_cache[0].shape[4]
    if any(tuple(kv.shape) != tuple(kv_cache[0].shape) for kv in kv_cache):
        return "the layers' K/V caches differ in shape"
    ahd = heads * hd
    d_mlp = layers[0].gu_w.shape[0] // 2
    checks = [("tok_w", weights.tok_w, (d, hidden)), ("tok_b", weights.tok_b, (d,)),
              ("qry_b", weights.qry_b, (weights.qry_w.shape[0],))]
    for i, lw in enumerate(layers):
        checks += [(f"qkv_w[{i}]", lw.qkv_w, (6 * ahd, d)), (f"qkv_b[{i}]", lw.qkv_b, (6 * ahd,)),
                   (f"o_w[{i}]", lw.o_w, (d, ahd)), (f"gu_w[{i}]", lw.gu_w, (2 * d_mlp, d)),
                   (f"gu_b[{i}]", lw.gu_b, (2 * d_mlp,)), (f"down_w[{i}]", lw.down_w, (d, d_mlp))]
    for name, t, shape in checks:
        if tuple(t.shape) != shape:
            return f"{name} has shape {tuple(t.shape)}, the stack needs {shape}"
    if weights.qry_w.dim() != 2 or weights.qry_w.shape[1] != d:
        return f"qry_w {tuple(weights.qry_w.shape)} is not [n_q, d = {d}]"
    if any(k % 8 for k in (hidden, d, ahd, d_mlp)):
        return f"K = {hidden}, {d}, {ahd}, {d_mlp}: every linear layer's K must be a multiple of 8"
    return None


def unsupported_reason(
    emb: Tensor, weights: StackWeights, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor,
    valid: Tensor, kv_cache: list[Tensor], key_bias: Tensor, p0: int, scale: float,
) -> str | None:
    """None when the kernel takes these inputs, else why not (host-side metadata only; the device is
    checked after the shapes, so CPU tensors the kernel would take give NOT_CUDA)."""
    dt = emb.dtype
    ws = _weight_list(weights)
    if dt not in DTYPE_CODE or any(t.dtype != dt for t in (*ws, rope, key_bias, *kv_cache)):
        return "the activations, weights, rope table, K/V caches and key mask must share one of float32, bfloat16, float16"
    reason = _shape_reason(emb, weights, kv_cache)
    if reason is not None:
        return reason
    if node_ids.dim() != 2 or node_ids.shape[0] * node_ids.shape[1] != emb.shape[0]:
        return f"node_ids {tuple(node_ids.shape)} is not [R, w] with R w = {emb.shape[0]} rows of emb"
    if emb.shape[0] > MAX_ROWS:
        return f"{emb.shape[0]} rows R w: the kernel takes at most {MAX_ROWS}"
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (emb, *ws)):
        return "emb and the weights must be contiguous and 16-byte aligned"
    heads, hd = kv_cache[0].shape[2], kv_cache[0].shape[4]
    proj_meta = torch.empty((emb.shape[0], 6 * heads * hd), dtype=dt, device="meta")
    for li, kv in enumerate(kv_cache):  # what the attention kernel needs, proj aside (the stack's own buffer)
        why = attention.unsupported_reason(proj_meta, rope, node_ids, parent_ids, depths, valid, kv, key_bias, p0,
                                           scale, li == 0)
        if why is not None and why != attention.NOT_CUDA:
            return f"layer {li}'s attention: {why}"
    tensors = (emb, *ws, rope, node_ids, parent_ids, depths, valid, key_bias, *kv_cache)
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        return NOT_CUDA
    reason = kernels_unavailable_reason(emb.device.index)
    if reason is not None:
        return reason
    n_slots = key_bias.shape[1] - 2
    if _slots(len(kv_cache), node_ids.shape[1], p0 + n_slots, hd, dt.itemsize,
              device_smem_optin(tensor_device_index(emb))) == 0:
        return "the chunk rings and the attention's staging do not fit the device's shared memory"
    return None


def weaver_stack(
    emb: Tensor, weights: StackWeights, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor,
    valid: Tensor, kv_cache: list[Tensor], key_bias: Tensor, p0: int, scale: float,
) -> Tensor:
    """The stack through the kernel where it runs, else the reference (module docstring)."""
    args = (emb, weights, rope, node_ids, parent_ids, depths, valid, kv_cache, key_bias, p0, scale)
    reason = unsupported_reason(*args)
    if reason is not None:
        if reason != NOT_CUDA and emb.is_cuda:
            warn_fallback("weaver_stack", reason)
        return weaver_stack_reference(*args)
    return weaver_stack_kernel(*args)


class _Layer(KernelStruct):
    """``WSLayer`` of the source, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("qkv_w", "qkv_b", "o_w", "gu_w", "gu_b", "down_w", "kv", "proj", "attn", "x_mid", "h", "x_out")] + [
        ("attn_eps", ctypes.c_float), ("mlp_eps", ctypes.c_float)]


class _Args(KernelStruct):
    """``WSArgs`` of the source, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("emb", "tok_w", "tok_b", "qry_w", "qry_b", "x0", "qry", "rope", "node_ids", "parent_ids", "depths",
                 "valid", "key_bias", "bar")] + [
        (name, ctypes.c_float) for name in ("tok_eps", "qry_eps", "scale")] + [
        (name, ctypes.c_int) for name in
        ("hidden", "d", "heads", "d_mlp", "n_q", "S", "p0", "n_slots", "cols", "D", "w", "R")] + [
        ("layer", _Layer * MAX_LAYERS), ("marks", ctypes.c_void_p)]


def timeline_stages(n_layers: int) -> list[str]:
    """The stack's stages in the order they run (the rows of ``weaver_stack_kernel``'s ``marks``)."""
    per_layer = ("qkv", "attention", "o_proj", "gate_up", "down")
    return ["token_in", *(f"{name}{li}" for li in range(n_layers) for name in per_layer), "query"]


def _scratch(m: int, sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """[m, size] buffers carved from one allocation, each starting on its own ALIGN-byte line."""
    per = ALIGN // torch.tensor([], dtype=dtype).element_size()
    lengths = [-(-m * s // per) * per for s in sizes]
    flat = torch.empty(sum(lengths) + per, dtype=dtype, device=device)
    skip = (-flat.data_ptr() % ALIGN) // flat.element_size()
    out, at = [], skip
    for s, n in zip(sizes, lengths):
        out.append(flat[at: at + m * s].view(m, s))
        at += n
    return out


def weaver_stack_kernel(
    emb: Tensor, weights: StackWeights, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor,
    valid: Tensor, kv_cache: list[Tensor], key_bias: Tensor, p0: int, scale: float, ctas: int | None = None,
    slots: int | None = None, defines: tuple[str, ...] = (), marks: Tensor | None = None,
) -> Tensor:
    """The launch itself, for inputs ``unsupported_reason`` accepts (not checked again). ``ctas``: the
    grid (default: one block per SM of the device; the CPU emulation's tests pass a few); ``slots``: chunk
    slots per warp (default: the most that fit, at most MAX_SLOTS); ``defines``: more -D options (the
    bench's variants, e.g. ``-DTFM_GRID_BARRIER=1``); ``marks``: an int64 ``[ctas, stages, 2]`` tensor
    (``timeline_stages``) that a timing build (``WS_TIMELINE``) fills with each block's global-timer ns
    at every stage's start and end."""
    dt, dev = emb.dtype, emb.device
    m, hidden = emb.shape
    r, w = node_ids.shape
    n_layers = len(weights.layers)
    d = weights.tok_w.shape[0]
    n_q = weights.qry_w.shape[0]
    _, _, heads, s_keys, hd = kv_cache[0].shape
    d_mlp = weights.layers[0].gu_w.shape[0] // 2
    n_slots, cols = key_bias.shape[1] - 2, key_bias.shape[2]
    qry = torch.empty(m, n_q, dtype=dt, device=dev)
    if m == 0:
        return qry
    ahd = heads * hd
    bufs = _scratch(m, [d] + [6 * ahd, ahd, d, d_mlp, d] * n_layers, dt, dev)
    # the grid barrier's two ints, then the stage counters of WS_SYNC 1 (MAX_SYNCS); fresh per call
    bar = torch.zeros(2 + MAX_SYNCS, dtype=torch.int32, device=dev)
    fit = _slots(n_layers, w, p0 + n_slots, hd, dt.itemsize, device_smem_optin(tensor_device_index(emb)))
    slots = fit if slots is None else min(slots, fit)
    if ctas is None:
        ctas = grid_size(tensor_device_index(emb))
    if marks is not None:
        want = (ctas, len(timeline_stages(n_layers)), 2)
        if tuple(marks.shape) != want or marks.dtype != torch.int64 or marks.device != dev or not marks.is_contiguous():
            raise ValueError(f"marks must be a contiguous int64 tensor of shape {want} on {dev}")
        defines = (*defines, "-DWS_TIMELINE=1")
    ptr = Tensor.data_ptr
    a = _Args(emb=ptr(emb), tok_w=ptr(weights.tok_w), tok_b=ptr(weights.tok_b), qry_w=ptr(weights.qry_w),
              qry_b=ptr(weights.qry_b), x0=ptr(bufs[0]), qry=ptr(qry), rope=ptr(rope), node_ids=ptr(node_ids),
              parent_ids=ptr(parent_ids), depths=ptr(depths), valid=ptr(valid), key_bias=ptr(key_bias), bar=ptr(bar),
              tok_eps=weights.tok_eps, qry_eps=weights.qry_eps, scale=scale, hidden=hidden, d=d, heads=heads,
              d_mlp=d_mlp, n_q=n_q, S=s_keys, p0=p0, n_slots=n_slots, cols=cols, D=rope.shape[0], w=w, R=r,
              marks=0 if marks is None else ptr(marks))
    for li, (lw, kv) in enumerate(zip(weights.layers, kv_cache)):
        proj, attn, x_mid, h, x_out = bufs[1 + 5 * li: 6 + 5 * li]
        a.layer[li] = _Layer(qkv_w=ptr(lw.qkv_w), qkv_b=ptr(lw.qkv_b), o_w=ptr(lw.o_w), gu_w=ptr(lw.gu_w),
                             gu_b=ptr(lw.gu_b), down_w=ptr(lw.down_w), kv=ptr(kv), proj=ptr(proj), attn=ptr(attn),
                             x_mid=ptr(x_mid), h=ptr(h), x_out=ptr(x_out), attn_eps=lw.attn_eps, mlp_eps=lw.mlp_eps)
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[dt]}", f"-DWS_M={m}", f"-DWS_LAYERS={n_layers}",
            f"-DWS_HD={hd}", f"-DWS_NSLOT={slots}", *defines]
    kernel = get_kernel(SOURCE, "weaver_stack", opts, tensor_device_index(emb))
    launch(kernel, (ctas, 1, 1), (THREADS, 1, 1), [a],
           shared_mem=stack_smem_bytes(slots, n_layers, w, p0 + n_slots, hd, dt.itemsize), cooperative=True)
    return qry

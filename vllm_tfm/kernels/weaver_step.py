"""One Weaver step of the batched tree scorer in one launch (``cuda/weaver_step.cu``).

``BatchedWeaverTreeScorer`` with ``score_kernel`` runs a call's Weaver step as 2 + 5 L kernels (the token_in
linear, per layer the qkv linear, the node attention, o_proj, gate_up and down, then the query linear:
``weaver_linear`` and ``weaver_attention``). ``weaver_step_kernel`` runs the same device functions with the
same arguments in one cooperative launch, the stages separated by grid barriers, so its outputs (the query
rows, each layer's K/V cache and the first layer's key-mask rows) are the per-kernel path's bit for bit, with
one launch instead of 17 at the 27B shape (3 layers).

It takes what both kernels of the per-kernel path take, for every layer (``unsupported_reason`` asks
``weaver_linear.unsupported_reason`` and ``weaver_attention.unsupported_reason`` themselves), with the
embedding a table the token_in layer gathers from and every projection FP8 (``FoldedWeaver`` with e4m3 rows,
at most ``weaver_linear.FP8_KERNEL_ROWS`` rows) or none. Off unless ``VLLM_TFM_WEAVER_STEP_KERNEL=1``
(``ENV_SWITCH``): not yet measured faster on a GPU.

Scratch: ``StepBuffers`` (the residual stream twice, the projection, the attention output, the MLP
activation, the query rows, two ints for the grid barrier), made once per scorer and width; the kernel
reuses them call after call (one step kernel at a time per buffer set: the scorer's calls are in stream order).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vllm_tfm.kernels import weaver_attention as attention_kernel
from vllm_tfm.kernels import weaver_linear as linear_kernel
from vllm_tfm.kernels.loader import get_kernel, launch, max_resident_blocks, tensor_device_index, warn_fallback

if TYPE_CHECKING:
    from vllm_tfm.models.weaver_step import FoldedWeaver

__all__ = ["ENV_SWITCH", "MAX_LAYERS", "StepBuffers", "WsLinear", "enabled", "params_type", "step_buffers",
           "unsupported_reason", "warn_unsupported", "weaver_step_kernel"]

SOURCE = "weaver_step.cu"
THREADS = 32 * linear_kernel.WARPS  # WL_WARPS x 32 in the source; the attention's WA_THREADS is the same
MAX_LAYERS = 8  # WS_MAX_LAYERS in the source
ENV_SWITCH = "VLLM_TFM_WEAVER_STEP_KERNEL"


def enabled() -> bool:
    """``VLLM_TFM_WEAVER_STEP_KERNEL=1``: the scorer runs its step through this kernel where it takes the inputs."""
    return os.environ.get(ENV_SWITCH, "0") == "1"


class WsLinear(ctypes.Structure):
    """``struct WsLinear`` of the source: weight rows, their e4m3 scales or null, bias or null, the norm's eps."""

    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("pad", ctypes.c_int)]


@cache
def params_type(n_layers: int) -> type[ctypes.Structure]:
    """``struct WsParams`` of the source compiled with ``WS_LAYERS = n_layers`` (same fields, same order)."""
    per_layer = WsLinear * n_layers
    ptr = ctypes.c_void_p
    fields = [("token_in", WsLinear), ("qkv", per_layer), ("o", per_layer), ("gate_up", per_layer),
              ("down", per_layer), ("query", WsLinear), ("kv", ptr * n_layers)]
    fields += [(name, ptr) for name in ("embed", "tokens", "rope", "node_ids", "parent_ids", "depths", "valid",
                                        "key_bias", "xa", "xb", "proj", "att", "act", "out", "barrier")]
    fields += [("embed_rows", ctypes.c_longlong)]
    fields += [(name, ctypes.c_int) for name in ("hidden", "d", "d_mlp", "heads", "R", "w", "S", "p0", "n_slots",
                                                 "cols", "D")]
    fields += [("attn_scale", ctypes.c_float)]
    return type(f"WsParams{n_layers}", (ctypes.Structure,), {"_fields_": fields})


@dataclass(frozen=True)
class StepBuffers:
    """The step kernel's scratch for M rows (module docstring)."""

    xa: Tensor  # [M, d]
    xb: Tensor  # [M, d]
    proj: Tensor  # [M, 6 d]
    att: Tensor  # [M, d]
    act: Tensor  # [M, d_mlp]
    out: Tensor  # [M, hidden]
    barrier: Tensor  # int32 [2], zeros


def step_buffers(folded: FoldedWeaver, m: int, dtype: torch.dtype, device: torch.device) -> StepBuffers:
    """Scratch for M rows of this Weaver (the barrier's two ints zeroed: one kernel launch, once)."""
    d, hidden = folded.token_in.shape[1], folded.token_in.shape[0]
    d_mlp = folded.layers[0].down.shape[0]

    def empty(cols: int) -> Tensor:
        return torch.empty(m, cols, dtype=dtype, device=device)

    return StepBuffers(empty(d), empty(d), empty(6 * d), empty(d), empty(d_mlp), empty(hidden),
                       torch.zeros(2, dtype=torch.int32, device=device))


def _fp8(folded: FoldedWeaver, m: int) -> bool:
    """The per-kernel path's choice (``models.weaver._fused_linear``): e4m3 rows where there are some and M allows."""
    return folded.token_in_fp8 is not None and m <= linear_kernel.FP8_KERNEL_ROWS


def _linears(folded: FoldedWeaver, fp8: bool) -> list[tuple[str, Tensor, Tensor | None, Tensor | None, float | None, bool]]:
    """(name, weight [N', K], row scales, bias, eps, SwiGLU) of every linear, in the step's order, as the per-kernel
    path passes them to ``weaver_linear``."""
    def pick(weight_t: Tensor, rows) -> tuple[Tensor, Tensor | None]:
        return (rows.q, rows.scale) if fp8 else (weight_t.t(), None)

    out = [("token_in", *pick(folded.token_in, folded.token_in_fp8), folded.token_in_bias, folded.embed_eps, False)]
    for i, lw in enumerate(folded.layers):
        out += [(f"qkv{i}", *pick(lw.qkv_rot, lw.qkv_rot_fp8), lw.qkv_rot_bias, lw.attn_eps, False),
                (f"o{i}", *pick(lw.o_proj, lw.o_proj_fp8), None, None, False),
                (f"gate_up{i}", *pick(lw.gate_up, lw.gate_up_fp8), lw.gate_up_bias, lw.mlp_eps, True),
                (f"down{i}", *pick(lw.down, lw.down_fp8), None, None, False)]
    out.append(("query", *pick(folded.query, folded.query_fp8), folded.query_bias, folded.out_eps, False))
    return out


def _linear_inputs(bufs: StepBuffers, embed: Tensor, tokens: Tensor, n_layers: int) -> list[tuple[Tensor, Tensor | None, Tensor | None]]:
    """(x, residual, rows) of every linear in the step's order: the scratch buffers the kernel reads."""
    out = [(embed, None, tokens)]
    for _ in range(n_layers):
        out += [(bufs.xa, None, None), (bufs.att, bufs.xa, None), (bufs.xb, None, None), (bufs.act, bufs.xb, None)]
    out.append((bufs.xa, None, None))
    return out


def unsupported_reason(folded: FoldedWeaver, embed: Tensor, tokens: Tensor, rope: Tensor, node_ids: Tensor,
                       parent_ids: Tensor, depths: Tensor, valid: Tensor, kv_cache: list[Tensor], key_bias: Tensor,
                       p0: int, scale: float, bufs: StepBuffers) -> str | None:
    """None when the kernel takes a scorer call with these operands (tokens: [M] int64), else why not: the reasons of
    ``weaver_linear`` and ``weaver_attention`` for each of their layers, or the step's own."""
    n_layers = len(folded.layers)
    if not 1 <= n_layers <= MAX_LAYERS:
        return f"{n_layers} layers: the kernel takes 1 to {MAX_LAYERS}"
    m = tokens.shape[0]
    fp8 = _fp8(folded, m)
    if not fp8 and folded.token_in_fp8 is not None:
        return f"{m} rows: over the FP8 kernel's {linear_kernel.FP8_KERNEL_ROWS}"
    if bufs.xa.shape[0] != m or not bufs.barrier.is_contiguous():
        return f"scratch for {bufs.xa.shape[0]} rows, not the call's {m}"
    if embed.dim() != 2 or embed.stride(0) != embed.shape[1]:
        return "the embedding's rows are not contiguous (the kernel reads rows of hidden elements)"
    for (name, w, ws, b, eps, swiglu), (x, res, rows) in zip(_linears(folded, fp8), _linear_inputs(bufs, embed, tokens, n_layers)):
        reason = linear_kernel.unsupported_reason(x, w, b, res, eps, swiglu, ws, rows)
        if reason is not None:
            return f"{name}: {reason}"
    for li, kv in enumerate(kv_cache):
        reason = attention_kernel.unsupported_reason(bufs.proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias,
                                                     p0, scale, li == 0)
        if reason is not None:
            return f"attention {li}: {reason}"
    return None


def warn_unsupported(reason: str, is_cuda: bool) -> None:
    """The one-time warning of a CUDA scorer whose calls the switched-on kernel does not take (not for CPU tensors)."""
    if is_cuda and linear_kernel.NOT_CUDA not in reason and attention_kernel.NOT_CUDA not in reason:
        warn_fallback("weaver_step", reason)


def _stage_blocks(folded: FoldedWeaver, fp8: bool, m: int, heads: int, r: int) -> tuple[list[int], int]:
    """(K split of each linear, the most blocks any stage has): as the per-kernel launches (weaver_linear_kernel)."""
    splits, most = [], heads * r
    for _, w, _, _, _, swiglu in _linears(folded, fp8):
        n = w.shape[0] // 2 if swiglu else w.shape[0]
        units = n if swiglu else (n + 1) // 2
        split = linear_kernel.k_split(units, w.shape[1], 512 if fp8 else 256)
        splits.append(split)
        most = max(most, -(-units * split // linear_kernel.WARPS))
    return splits, most


def weaver_step_kernel(folded: FoldedWeaver, embed: Tensor, tokens: Tensor, rope: Tensor, node_ids: Tensor,
                       parent_ids: Tensor, depths: Tensor, valid: Tensor, kv_cache: list[Tensor], key_bias: Tensor,
                       p0: int, scale: float, bufs: StepBuffers, blocks: int | None = None) -> Tensor:
    """The launch, for operands ``unsupported_reason`` accepts (not checked again): the query rows [M, hidden]
    (``bufs.out``); each layer's K/V cache and, from layer 0, the nodes' key-mask rows written as the per-kernel
    path writes them. ``blocks``: the grid (default: every stage's blocks, at most what the device holds at once)."""
    r, w = node_ids.shape
    m = r * w
    n_layers = len(folded.layers)
    fp8 = _fp8(folded, m)
    heads, hd, n_slots, cols = attention_kernel._shape(kv_cache[0], key_bias)
    splits, most = _stage_blocks(folded, fp8, m, heads, r)
    tok, qkv, o, gu, dn = splits[0], splits[1], splits[2], splits[3], splits[4]
    qry = splits[-1]
    dtype = embed.dtype
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={linear_kernel.DTYPE_CODE[dtype]}", f"-DWL_M={m}",
            f"-DWL_W8={int(fp8)}", f"-DWA_HD={hd}", f"-DWS_LAYERS={n_layers}", f"-DWS_KS_TOK={tok}",
            f"-DWS_KS_QKV={qkv}", f"-DWS_KS_O={o}", f"-DWS_KS_GU={gu}", f"-DWS_KS_DN={dn}", f"-DWS_KS_QRY={qry}"]
    kernel = get_kernel(SOURCE, "weaver_step", opts, tensor_device_index(embed))
    smem = max(attention_kernel.attention_smem_bytes(w, p0 + n_slots, hd, dtype.itemsize),
               4 * linear_kernel.WARPS * m * 3)
    if blocks is None:
        blocks = min(most, max_resident_blocks(kernel, THREADS, smem))
    params = _params(folded, fp8, embed, tokens, rope, node_ids, parent_ids, depths, valid, kv_cache, key_bias, p0,
                     scale, bufs, r, w, heads, n_slots, cols)
    launch(kernel, (max(1, blocks), 1, 1), (THREADS, 1, 1), [params], shared_mem=smem, cooperative=True)
    return bufs.out


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _params(folded: FoldedWeaver, fp8: bool, embed: Tensor, tokens: Tensor, rope: Tensor, node_ids: Tensor,
            parent_ids: Tensor, depths: Tensor, valid: Tensor, kv_cache: list[Tensor], key_bias: Tensor, p0: int,
            scale: float, bufs: StepBuffers, r: int, w: int, heads: int, n_slots: int, cols: int) -> ctypes.Structure:
    n_layers = len(folded.layers)
    rows = [WsLinear(_ptr(wt), _ptr(ws), _ptr(b), 0.0 if eps is None else eps, 0)
            for _, wt, ws, b, eps, _ in _linears(folded, fp8)]
    per_layer = WsLinear * n_layers
    p = params_type(n_layers)()
    p.token_in, p.query = rows[0], rows[-1]
    p.qkv = per_layer(*rows[1:-1:4])
    p.o = per_layer(*rows[2:-1:4])
    p.gate_up = per_layer(*rows[3:-1:4])
    p.down = per_layer(*rows[4:-1:4])
    p.kv = (ctypes.c_void_p * n_layers)(*(kv.data_ptr() for kv in kv_cache))
    for name, t in (("embed", embed), ("tokens", tokens), ("rope", rope), ("node_ids", node_ids),
                    ("parent_ids", parent_ids), ("depths", depths), ("valid", valid), ("key_bias", key_bias),
                    ("xa", bufs.xa), ("xb", bufs.xb), ("proj", bufs.proj), ("att", bufs.att), ("act", bufs.act),
                    ("out", bufs.out), ("barrier", bufs.barrier)):
        setattr(p, name, t.data_ptr())
    p.embed_rows = embed.shape[0]
    p.hidden, p.d = embed.shape[1], bufs.xa.shape[1]
    p.d_mlp, p.heads, p.R, p.w, p.S = bufs.act.shape[1], heads, r, w, kv_cache[0].shape[3]
    p.p0, p.n_slots, p.cols, p.D, p.attn_scale = p0, n_slots, cols, rope.shape[0], scale
    return p

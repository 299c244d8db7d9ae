"""One Weaver layer's node attention in one launch (``cuda/weaver_attention.cu``).

``node_attention`` has the signature of ``node_attention_reference`` and computes the same
function for the nodes of one ``BatchedWeaverTreeScorer`` call: RoPE of the qkv projection (from
the GEMM's rotate_half rows and the per-depth table), the valid nodes' K/V written into the
per-request cache, their key-mask rows (``write_mask``: the call's first layer), and attention of
each node over the prompt and its ancestors-or-self, returned as ``[R w, heads hd]`` (the o_proj's
input layout). The reference is the scorer's torch path (mul / addcmul, scatter, SDPA with the
additive mask, a copy); the kernel keeps the scores and probabilities in float32 and rounds the
output once (the same function to the activation dtype's rounding of the output). The rotated K/V
are rounded as the reference rounds them (after the product, after the multiply-add), so the
cache agrees with the reference's to one rounding (a fused or a separate multiply-add); the key-mask
rows of valid nodes are the reference's bit for bit. Invalid rows write nothing in the kernel (the
reference writes them to the trash slot) and their outputs mean nothing in both.

The kernel runs for CUDA tensors of one dtype (float32, bfloat16 or float16), head rows of a
multiple of 16 bytes, contiguous kv / key_bias (at most 288 columns) / rope table / [R, w] index tensors and
projection rows, and shared memory for the staged K and V rows within the device's limit; anything else
(and ``VLLM_TFM_WEAVER_ATTENTION_KERNEL=0``) calls the reference, with a one-time warning for CUDA
inputs the kernel does not take. It is launched with programmatic dependent launch unless
``VLLM_TFM_WEAVER_CHAIN_PDL=0`` (``chain_pdl``): it stages its K / V rows while the qkv linear before it still runs.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F
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
    "CHAIN_PDL_SWITCH",
    "ENV_SWITCH",
    "NOT_CUDA",
    "attention_smem_bytes",
    "chain_pdl",
    "node_attention",
    "node_attention_kernel",
    "node_attention_reference",
    "unsupported_reason",
]

SOURCE = "weaver_attention.cu"
THREADS = 128  # WA_THREADS in the source
WARPS = THREADS // 32
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ENV_SWITCH = "VLLM_TFM_WEAVER_ATTENTION_KERNEL"
# this kernel and the candidate scores launched with programmatic dependent launch (on unless "0"; chain_pdl)
CHAIN_PDL_SWITCH = "VLLM_TFM_WEAVER_CHAIN_PDL"
NOT_CUDA = "the tensors are not all on one CUDA device"
MAX_GRID_Y = 65535
MAX_COLS = 32 * 9  # 32 lanes x WA_KEY_ITERS key columns in the source


def chain_pdl() -> bool:
    """Whether the scorer's attention and candidate-score kernels are launched with programmatic dependent launch
    (``VLLM_TFM_WEAVER_CHAIN_PDL``, read at every launch; on unless ``0``): each may start while the linear before
    it still runs, doing what does not read that linear's output (the attention stages the K / V rows of its span,
    the candidate scores fetch their lm_head rows into L2) before it waits for it. The same outputs bit for bit."""
    return os.environ.get(CHAIN_PDL_SWITCH, "1") != "0"


def _shape(kv: Tensor, key_bias: Tensor) -> tuple[int, int, int, int]:
    """(heads, head_dim, node slots n, key columns cols) of a scorer layer's cache and mask."""
    return kv.shape[2], kv.shape[4], key_bias.shape[1] - 2, key_bias.shape[2]


def node_attention_reference(
    proj: Tensor, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor, valid: Tensor,
    kv: Tensor, key_bias: Tensor, p0: int, scale: float, write_mask: bool,
) -> Tensor:
    """The torch path.

    proj [R w, 2 * 3 * heads * hd]: q, k, v then their rotate_half rows (the folded qkv GEMM);
    rope [D, 2 (cos, sin), 3 (q, k, v), 1, hd]: the node positions' table (v: cos 1, sin 0);
    node_ids, parent_ids, depths [R, w] int64, valid [R, w] bool; kv [2, R, heads, p0 + n + 1, hd]
    (prompt keys, n node slots, the trash slot); key_bias [R, n + 2, cols] (0 visible, -inf not;
    row n the trash slot's, row n + 1 the prompt only, for parent -1). Returns [R w, heads hd].
    """
    r, w = node_ids.shape
    heads, hd, n, cols = _shape(kv, key_bias)
    span = p0 + n  # keys a node may attend to: the prompt and the node slots
    slot = torch.where(valid, node_ids, n)  # invalid rows: the trash slot
    key = p0 + slot  # the key column of each node's own K/V
    # the parent's mask row (row n + 1 = the prompt only, for the root's parent -1) plus the node itself
    row = key_bias.gather(1, parent_ids.remainder(n + 2)[..., None].expand(r, w, cols))
    row.scatter_(2, key[..., None], 0.0)
    if write_mask:
        key_bias.scatter_(1, slot[..., None].expand(r, w, cols), row)
    bias = row[:, None, :, :span]  # [R, 1, w, S]
    cos, sin = rope[depths.clamp(0, rope.shape[0] - 1)].unbind(2)  # [R, w, 3, 1, hd] each
    proj, proj_rot = proj.view(r, w, 2, 3, heads, hd).unbind(2)
    qkv = torch.empty(3, r, heads, w, hd, dtype=proj.dtype, device=proj.device)
    rotated = qkv.permute(1, 3, 0, 2, 4)  # [R, w, 3, heads, hd] view of the buffer
    torch.mul(proj, cos, out=rotated)
    rotated.addcmul_(proj_rot, sin)
    kv.scatter_(3, key[None, :, None, :, None].expand(2, r, heads, w, hd), qkv[1:])
    attn = F.scaled_dot_product_attention(
        qkv[0], kv[0, :, :, :span], kv[1, :, :, :span], attn_mask=bias, scale=scale
    )  # [R, heads, w, hd]
    return attn.transpose(1, 2).reshape(r * w, heads * hd)


def attention_smem_bytes(w: int, span: int, hd: int, elem: int) -> int:
    """Dynamic shared memory of one launch (mirrors the kernel's layout): the span keys' K rows padded
    by 16 bytes and V rows as stored, float32 q and own v of the w rows, a mask / probability row per
    node, and per node its own score and key column (4 bytes each)."""
    return span * (2 * hd * elem + 16) + 4 * (2 * w * hd + w * span + 2 * w)


def unsupported_reason(
    proj: Tensor, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor, valid: Tensor,
    kv: Tensor, key_bias: Tensor, p0: int, scale: float, write_mask: bool,
) -> str | None:
    """None when the kernel takes these inputs, else why not (host-side metadata only; the device
    is checked last, so CPU tensors the kernel would take give NOT_CUDA)."""
    dt = proj.dtype
    if dt not in DTYPE_CODE or any(t.dtype != dt for t in (rope, kv, key_bias)):
        return (f"dtypes proj {proj.dtype}, rope {rope.dtype}, kv {kv.dtype}, key_bias {key_bias.dtype}: the "
                "kernel takes one of float32, bfloat16, float16 for all")
    if any(t.dtype != torch.long for t in (node_ids, parent_ids, depths)) or valid.dtype != torch.bool:
        return "node_ids, parent_ids and depths must be int64 and valid bool"
    if kv.dim() != 5 or kv.shape[0] != 2 or key_bias.dim() != 3 or rope.dim() != 5 or node_ids.dim() != 2:
        return "shapes are not kv [2, R, heads, S, hd], key_bias [R, n + 2, cols], rope [D, 2, 3, 1, hd], nodes [R, w]"
    heads, hd, n, cols = _shape(kv, key_bias)
    r, w = node_ids.shape
    if kv.shape[1] != r or key_bias.shape[0] != r or tuple(rope.shape[1:]) != (2, 3, 1, hd):
        return f"kv {tuple(kv.shape)}, key_bias {tuple(key_bias.shape)}, rope {tuple(rope.shape)} do not match R={r}, hd={hd}"
    if kv.shape[3] != p0 + n + 1 or cols < p0 + n + 1:
        return f"kv has {kv.shape[3]} key slots and key_bias {cols} columns for p0 + n + 1 = {p0 + n + 1}"
    if tuple(proj.shape) != (r * w, 6 * heads * hd):
        return f"proj {tuple(proj.shape)} is not [R w = {r * w}, 6 heads hd = {6 * heads * hd}]"
    if (hd * dt.itemsize) % 16:
        return f"head rows of {hd} elements are not a multiple of 16 bytes"
    tensors = (proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias)
    if not all(t.is_contiguous() for t in tensors) or proj.data_ptr() % 16 or kv.data_ptr() % 16:
        return "the tensors are not contiguous with 16-byte aligned proj and kv"
    if cols > MAX_COLS:
        return f"key_bias has {cols} columns, over the kernel's {MAX_COLS} (32 lanes x {MAX_COLS // 32})"
    if r > MAX_GRID_Y:
        return f"{r} requests are over the kernel's {MAX_GRID_Y}"
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        return NOT_CUDA
    reason = kernels_unavailable_reason(proj.device.index)
    if reason is not None:
        return reason
    smem = attention_smem_bytes(w, p0 + n, hd, dt.itemsize)
    limit = device_smem_optin(tensor_device_index(proj))
    if smem > limit:
        return f"the staged K and V rows need {smem} bytes of shared memory; the device allows {limit}"
    return None


def node_attention(
    proj: Tensor, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor, valid: Tensor,
    kv: Tensor, key_bias: Tensor, p0: int, scale: float, write_mask: bool,
) -> Tensor:
    """[R w, heads hd] through the kernel where it runs, else the reference (module docstring)."""
    args = (proj, rope, node_ids, parent_ids, depths, valid, kv, key_bias, p0, scale, write_mask)
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return node_attention_reference(*args)
    reason = unsupported_reason(*args)
    if reason is not None:
        if reason != NOT_CUDA and proj.is_cuda:
            warn_fallback("weaver_attention", reason)
        return node_attention_reference(*args)
    return node_attention_kernel(*args)


def node_attention_kernel(
    proj: Tensor, rope: Tensor, node_ids: Tensor, parent_ids: Tensor, depths: Tensor, valid: Tensor,
    kv: Tensor, key_bias: Tensor, p0: int, scale: float, write_mask: bool,
) -> Tensor:
    """The launch itself, for inputs ``unsupported_reason`` accepts (not checked again)."""
    r, w = node_ids.shape
    heads, hd, n, cols = _shape(kv, key_bias)
    out = torch.empty(r * w, heads * hd, dtype=proj.dtype, device=proj.device)
    if r * w == 0:
        return out
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[proj.dtype]}", f"-DWA_HD={hd}"]
    kernel = get_kernel(SOURCE, "weaver_node_attention", opts, tensor_device_index(proj))
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    launch(
        kernel,
        (heads, r, 1),
        (THREADS, 1, 1),
        [proj, i64(proj.stride(0)), rope, node_ids, parent_ids, depths, valid, kv, key_bias, out,
         i32(w), i32(heads), i32(hd), i32(kv.shape[3]), i32(p0), i32(n), i32(cols), i32(rope.shape[0]),
         ctypes.c_float(scale), i32(1 if write_mask else 0)],
        shared_mem=attention_smem_bytes(w, p0 + n, hd, proj.dtype.itemsize),
        programmatic=chain_pdl(),
    )
    return out

"""One Weaver growth round in one launch (``cuda/weaver_round.cu``).

``weaver_round`` has the signature of ``vllm_tfm.tree.weaver_padded.weaver_round_reference``
(``RoundFn``) and computes the same round: it pushes the scored nodes' top-c children into the
frontier and materialises the next nodes of every request, one CTA per request, instead of the
reference's ~42 small torch kernels. The state tensors of the growth (frontier, node slots, budget
left, the log-probability flag) are updated in place as the reference does; the next round's scorer
inputs are written into buffers made once per growth (``KernelRound``), so with fixed shapes the
rounds stay capturable in a CUDA graph. Trees, node slots and the frontier slots of real nodes
equal the reference's exactly (the same comparisons on the same values; no arithmetic but one
float64 addition per child); the rows of the trash node that invalid columns write are unspecified
in both.

``round_fn_for(growth)`` returns a ``KernelRound`` when the kernel takes the growth (CUDA tensors,
kernels available, at most 64 nodes per round, at most 4 rank-path words, the frontier keys and a scored
row per warp in shared memory) and ``VLLM_TFM_WEAVER_ROUND_KERNEL`` is not ``0``; else None (the caller keeps the torch
round; a one-time warning says why for CUDA growths).
"""

from __future__ import annotations

import ctypes
import os

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
from vllm_tfm.tree.weaver_padded import RoundOutputs, WeaverGrowth

__all__ = ["ENV_SWITCH", "OUT_DTYPE_CODE", "KernelRound", "round_fn_for", "round_smem_bytes", "unsupported_reason"]

SOURCE = "weaver_round.cu"
THREADS = 128  # WR_THREADS in the source
WARPS = THREADS // 32
MAX_WIDTH = 64  # s_sel[64]
MAX_WORDS = 4  # WR_MAX_WORDS
OUT_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
ENV_SWITCH = "VLLM_TFM_WEAVER_ROUND_KERNEL"
NOT_CUDA = "the growth's tensors are not on a CUDA device"


def round_smem_bytes(growth: WeaverGrowth) -> int:
    """Dynamic shared memory of one launch: every frontier slot's score and rank-path words, then
    per warp one scored row (K float64 values) and its c children (float64 values, int32 indices)."""
    return (growth.fi.shape[1] * (1 + growth.nw) + WARPS * (growth.k + growth.c)) * 8 + WARPS * growth.c * 4


def unsupported_reason(growth: WeaverGrowth) -> str | None:
    """None when the kernel takes this growth, else why not (host-side metadata only)."""
    if growth.fi.device.type != "cuda":
        return NOT_CUDA
    if growth.w > MAX_WIDTH:
        return f"width {growth.w} is over the kernel's {MAX_WIDTH} nodes per round"
    if growth.nw > MAX_WORDS:
        return f"{growth.nw} rank-path words are over the kernel's {MAX_WORDS}"
    reason = kernels_unavailable_reason(growth.fi.device.index)
    if reason is not None:
        return reason
    smem = round_smem_bytes(growth)
    limit = device_smem_optin(tensor_device_index(growth.fi))
    if smem > limit:
        return f"the frontier keys and scored rows need {smem} bytes of shared memory; the device allows {limit}"
    return None



def round_fn_for(growth: WeaverGrowth) -> KernelRound | None:
    """The kernel round for ``growth``, or None (module docstring); allocates its output buffers."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    reason = unsupported_reason(growth)
    if reason is not None:
        if reason != NOT_CUDA:
            warn_fallback("weaver_round", reason)
        return None
    return KernelRound(growth)


def _per_request(limit: int | Tensor) -> tuple[Tensor | None, ctypes.c_longlong]:
    """(pointer tensor, scalar) of a per-request limit: a tensor's entries, or one int for all."""
    if isinstance(limit, int):
        return None, ctypes.c_longlong(limit)
    return limit.contiguous().view(-1), ctypes.c_longlong(0)


class KernelRound:
    """``RoundFn`` through the kernel for one growth: the next round's scorer inputs live in
    buffers made here (one set per growth, overwritten every round: a round's inputs are read
    before its outputs are written, in the kernel)."""

    def __init__(self, growth: WeaverGrowth) -> None:
        r_, w, dev = growth.r, growth.w, growth.fi.device
        i64 = torch.long
        self.node = torch.empty(r_, w, dtype=i64, device=dev)
        self.parent = torch.empty(r_, w, dtype=i64, device=dev)
        self.tok = torch.empty(r_, w, dtype=i64, device=dev)
        self.d = torch.empty(r_, w, dtype=i64, device=dev)
        self.depth_words = torch.empty(r_, w, 1 + growth.nw, dtype=i64, device=dev)
        self.score = torch.empty(r_, w, dtype=torch.float64, device=dev)
        self.expand = torch.empty(r_, w, dtype=torch.bool, device=dev)
        self.n_alive = torch.empty(r_, dtype=i64, device=dev)
        self.take = torch.empty(r_, dtype=i64, device=dev)
        self.room = torch.empty(r_, dtype=torch.bool, device=dev)
        self.outputs = RoundOutputs(
            self.node, self.parent, self.tok, self.d, self.depth_words, self.score, self.expand,
            self.n_alive, self.take, self.room,
        )
        self.width = _per_request(growth.width_limit)
        self.depth = _per_request(growth.depth_limit)
        self.budget1 = _per_request(growth.budget1)
        self.smem = round_smem_bytes(growth)
        self._kernels: dict[torch.dtype, object] = {}
        self.device_index = tensor_device_index(growth.fi)
        for name in ("fi", "ff", "node_slot", "left", "cand_flat", "step"):
            if not getattr(growth, name).is_contiguous():
                raise ValueError(f"weaver_round: growth.{name} must be contiguous")

    def _kernel(self, dtype: torch.dtype) -> object:
        kern = self._kernels.get(dtype)
        if kern is None:
            opts = ["--std=c++17", "-lineinfo", f"-DWR_OUT={OUT_DTYPE_CODE[dtype]}"]
            kern = self._kernels[dtype] = get_kernel(SOURCE, "weaver_round", opts, self.device_index)
        return kern

    def __call__(
        self, g: WeaverGrowth, out: Tensor, node: Tensor, d: Tensor, depth_words: Tensor, score: Tensor, valid: Tensor
    ) -> RoundOutputs:
        if out.dtype not in OUT_DTYPE_CODE:
            raise ValueError(f"weaver_round: scorer output dtype {out.dtype} (the kernel takes {list(OUT_DTYPE_CODE)})")
        m = node.shape[1]
        if out.stride(2) != 1:
            out = out.contiguous()
        for name, t in (("node", node), ("d", d), ("score", score), ("valid", valid)):
            if t.stride(1) != 1:
                raise ValueError(f"weaver_round: {name} must have unit stride along its nodes, got strides {t.stride()}")
        if depth_words.stride(2) != 1:
            raise ValueError(f"weaver_round: depth_words must be contiguous in its last dimension, got {depth_words.stride()}")
        i32, i64 = ctypes.c_int, ctypes.c_longlong
        (wt, wa), (dt, da), (bt, ba) = self.width, self.depth, self.budget1
        launch(
            self._kernel(out.dtype),
            (g.r, 1, 1),
            (THREADS, 1, 1),
            [out, i64(out.stride(0)), i64(out.stride(1)), valid, i64(valid.stride(0)),
             node, i64(node.stride(0)), d, i64(d.stride(0)), depth_words, i64(depth_words.stride(0)),
             i64(depth_words.stride(1)), score, i64(score.stride(0)),
             g.cand_flat, g.step, g.fi, g.ff, g.node_slot, g.left, g.fine,
             wt, wa, dt, da, bt, ba,
             self.node, self.parent, self.tok, self.d, self.depth_words, self.score, self.expand,
             self.n_alive, self.take, self.room,
             i32(m), i32(g.k), i32(g.c), i32(g.nw), i32(g.fi.shape[1]), i32(g.n_cap), i32(g.w), i32(g.dmax)],
            shared_mem=self.smem,
        )
        return self.outputs

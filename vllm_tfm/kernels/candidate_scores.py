"""The Weaver scorer's candidate scores in one launch (``cuda/candidate_scores.cu``).

``candidate_scores`` has the signature of ``vllm_tfm.models.vocab_table.candidate_scores_reference``
and computes the same function, ``cand_logits[r, d, k] + lm_head[cand_ids[r, d, k]] . queries[r, i]``
at every node's depth d, in float32 from the stored values, with the additions in another order
(agreeing to float32 rounding, not bit for bit). The torch path writes the K gathered lm_head rows
of every node and their float32 copy before a batched GEMV (at the 27B shape, R x w = 16 nodes,
~250 MB of traffic per scorer call); the kernel reads each row once.

The kernel runs for CUDA tensors: a plain ``[V, H]`` lm_head of float32, bfloat16 or float16 (not a
vocabulary-split ``ShardedVocabTable``), queries of the same dtype, candidate logits of one of the
three, H a multiple of 8 with 16-byte aligned rows; anything else (and ``VLLM_TFM_CANDIDATE_KERNEL=0``)
calls the reference, with a one-time warning for CUDA inputs the kernel does not take. It is launched with
programmatic dependent launch unless ``VLLM_TFM_WEAVER_CHAIN_PDL=0`` (``weaver_attention.chain_pdl``): its lm_head
rows go to L2 while the query linear before it still runs.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import Tensor

from vllm_tfm.kernels.loader import (
    aligned_rows,
    get_kernel,
    kernels_unavailable_reason,
    launch,
    tensor_device_index,
    warn_fallback,
)
from vllm_tfm.kernels.weaver_attention import chain_pdl
from vllm_tfm.models.vocab_table import VocabTable, candidate_scores_reference

__all__ = ["ENV_SWITCH", "NOT_CUDA", "WARPS", "candidate_scores", "candidate_scores_kernel", "unsupported_reason"]

SOURCE = "candidate_scores.cu"
WARPS = 4  # CS_WARPS in the source: candidates per CTA
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ENV_SWITCH = "VLLM_TFM_CANDIDATE_KERNEL"
NOT_CUDA = "the tensors are not all on one CUDA device"
MAX_GRID_Y = 65535


def unsupported_reason(
    lm_head: VocabTable, cand_ids: Tensor, cand_logits: Tensor, depths: Tensor, queries: Tensor
) -> str | None:
    """None when the kernel takes these inputs, else why not (host-side metadata only; the device
    is checked last, so CPU tensors the kernel would take give NOT_CUDA)."""
    if not isinstance(lm_head, Tensor):
        return "the lm_head is not a plain [V, H] tensor (a module or a vocabulary-split table)"
    if lm_head.dtype not in DTYPE_CODE or queries.dtype != lm_head.dtype or cand_logits.dtype not in DTYPE_CODE:
        return (f"dtypes lm_head {lm_head.dtype}, queries {queries.dtype}, logits {cand_logits.dtype}: the kernel "
                "takes float32, bfloat16 or float16 with queries of the lm_head's dtype")
    if cand_ids.dtype != torch.long or depths.dtype != torch.long:
        return f"cand_ids ({cand_ids.dtype}) and depths ({depths.dtype}) must be int64"
    if lm_head.dim() != 2 or cand_ids.dim() != 3 or depths.dim() != 2 or queries.dim() != 3:
        return "shapes are not lm_head [V, H], cand_ids [R, D, K], depths [R, w], queries [R, w, H]"
    h = lm_head.shape[1]
    if h % 8:
        return f"hidden size {h} is not a multiple of 8"
    rows = queries.reshape(-1, h)
    if not (aligned_rows(lm_head) and aligned_rows(rows) and rows.is_contiguous()):
        return "the lm_head's or the queries' rows are not contiguous and 16-byte aligned"
    if depths.shape[0] * depths.shape[1] > MAX_GRID_Y:
        return f"{depths.shape[0] * depths.shape[1]} nodes per call are over the kernel's {MAX_GRID_Y}"
    tensors = (lm_head, cand_ids, cand_logits, depths, queries)
    if not all(t.is_cuda for t in tensors) or len({t.device for t in tensors}) != 1:
        return NOT_CUDA
    return kernels_unavailable_reason(lm_head.device.index)


def _check_shapes(lm_head: Tensor, cand_ids: Tensor, cand_logits: Tensor, depths: Tensor, queries: Tensor) -> None:
    r, w = depths.shape
    if cand_ids.shape[0] != r or cand_logits.shape != cand_ids.shape:
        raise ValueError(f"candidate_scores: cand_ids and cand_logits must both be [R={r}, D, K], "
                         f"got {tuple(cand_ids.shape)} and {tuple(cand_logits.shape)}")
    if tuple(queries.shape) != (r, w, lm_head.shape[1]):
        raise ValueError(f"candidate_scores: queries must be [R={r}, w={w}, H={lm_head.shape[1]}], got {tuple(queries.shape)}")


def candidate_scores(
    lm_head: VocabTable, cand_ids: Tensor, cand_logits: Tensor, depths: Tensor, queries: Tensor
) -> Tensor:
    """[R, w, K] float32 candidate scores (module docstring); the reference where the kernel does not run."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return candidate_scores_reference(lm_head, cand_ids, cand_logits, depths, queries)
    reason = unsupported_reason(lm_head, cand_ids, cand_logits, depths, queries)
    if reason is not None:
        if reason != NOT_CUDA and isinstance(lm_head, Tensor) and lm_head.is_cuda:
            warn_fallback("candidate_scores", reason)
        return candidate_scores_reference(lm_head, cand_ids, cand_logits, depths, queries)
    return candidate_scores_kernel(lm_head, cand_ids, cand_logits, depths, queries)


def candidate_scores_kernel(lm_head: Tensor, cand_ids: Tensor, cand_logits: Tensor, depths: Tensor, queries: Tensor) -> Tensor:
    """The launch itself, for inputs ``unsupported_reason`` accepts (not checked again but the shapes)."""
    _check_shapes(lm_head, cand_ids, cand_logits, depths, queries)
    r, w = depths.shape
    d, k = int(cand_ids.shape[1]), int(cand_ids.shape[2])
    out = torch.empty(r, w, k, dtype=torch.float32, device=queries.device)
    if r * w == 0 or k == 0:
        return out
    ids, logits = cand_ids.contiguous(), cand_logits.contiguous()
    if depths.stride(1) != 1:
        depths = depths.contiguous()
    q = queries.reshape(r * w, -1)
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[lm_head.dtype]}", f"-DCS_LOGIT={DTYPE_CODE[logits.dtype]}"]
    kernel = get_kernel(SOURCE, "candidate_scores", opts, tensor_device_index(lm_head))
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    launch(
        kernel,
        (-(-k // WARPS), r * w, 1),
        (WARPS * 32, 1, 1),
        [lm_head, i64(lm_head.shape[0]), i64(lm_head.stride(0)), ids, logits, depths, i64(depths.stride(0)),
         q, i64(q.stride(0)), out, i32(w), i32(d), i32(k), i32(lm_head.shape[1])],
        programmatic=chain_pdl(),
    )
    return out

"""The DFlash drafter's logits through an FP8 copy of the target's lm_head (cuBLASLt through ``torch._scaled_mm``).

At the Qwen3.6-27B shape the drafter's logits are one GEMM of a few rows (15 per request at a DFlash block of
16) against the 248,320 x 5,120 lm_head: 2.54 GB of bfloat16 weights read per step, 893 us of a 25.4 ms batch-1
step on an H100 (bench/NOTES.md section 62). The drafts only propose; the target verifies every token with its
own bfloat16 lm_head, so the drafter may read an FP8 copy (half the bytes) at the price of rounding in the drafts.

* ``quantize_head(weight)``: [V, H] -> (float8 e4m3 [Vp, H], float32 scales [1, Vp]), one scale per vocabulary
  row (``amax / 448``), V padded with zero rows to a multiple of 16 (``torch._scaled_mm``'s layout rule).
* ``fp8_head_logits(x, wq, w_scale, vocab, quantize_rows=None)``: x [M, H] (bfloat16 / float16) -> [M, vocab]
  logits in x's dtype. Activations get one dynamic scale per row (e4m3, ``amax / 448``), rows padded to a
  multiple of 16 (the padding rows' results are dropped); the product accumulates in float32 with both scales
  applied in the epilogue (row-wise scaling). ``quantize_rows(x, rows)`` -> (e4m3 [>= rows, H], float32
  [>= rows, 1]) does the activations' part: ``quantize_rows_torch`` (six torch ops) unless the caller passes a
  fused kernel (the vLLM plugin passes vLLM's per-token FP8 quantization, one launch).
* ``scaled_mm_logits``: the same GEMM without the checks, for callers that checked once.
* ``fp8_round`` / ``fp8_round_rows`` / ``e4m3_scale``: the rounding itself in float (``reference/fp8_sim.py``
  builds its simulated FP8 layers from them).
* ``fp8_head_logits_reference``: the same signature and function in float32 on any device (the rounded
  activations times the dequantized weights), and what ``fp8_head_logits`` runs where ``torch._scaled_mm`` with
  row-wise scales does not (no CUDA, compute capability below 8.9, H not a multiple of 16), with a one-time
  warning for CUDA inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_tfm.kernels.loader import warn_fallback

__all__ = ["E4M3_MAX", "QuantizeRows", "e4m3_scale", "fp8_round", "fp8_round_rows", "quantize_head", "quantize_rows_torch",
           "fp8_head_logits", "fp8_head_logits_reference", "fp8_head_unsupported_reason", "scaled_mm_logits"]

QuantizeRows = Callable[[Tensor, int], tuple[Tensor, Tensor]]

E4M3_MAX = 448.0
_ALIGN = 16  # torch._scaled_mm: both dimensions of the second operand, and the shared one, multiples of 16
_TINY = torch.finfo(torch.float32).tiny
_QUANT_ROWS = 16384  # quantize_head's rows per chunk


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def e4m3_scale(amax: Tensor) -> Tensor:
    """The e4m3 scale that maps ``amax`` to 448, in float32 (never 0)."""
    return (amax.float() / E4M3_MAX).clamp_min(_TINY)


def fp8_round(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` rounded to ``scale`` times an e4m3 value (saturating at +-448 scale), in ``x``'s dtype."""
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def fp8_round_rows(x: Tensor) -> Tensor:
    """Per-row (token) dynamic scales over the last dimension: ``fp8_round(x, amax_row / 448)``."""
    return fp8_round(x, e4m3_scale(x.abs().amax(dim=-1, keepdim=True)))


def quantize_head(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[V, H] float weight -> (float8_e4m3fn [Vp, H], float32 [1, Vp]): per-row scales, Vp = V rounded up to 16
    with zero rows (scale 1). Done once, at load."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_head: the lm_head weight must be [V, H], got {tuple(weight.shape)}")
    v, h = weight.shape
    vp = _round_up(v, _ALIGN)
    q = torch.zeros(vp, h, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.ones(vp, dtype=torch.float32, device=weight.device)
    for start in range(0, v, _QUANT_ROWS):  # bounded float32 temporaries (a 27B head is 5 GB in float32)
        rows = weight.detach()[start:start + _QUANT_ROWS].float()
        s = e4m3_scale(rows.abs().amax(dim=1))
        q[start:start + rows.shape[0]] = (rows / s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scale[start:start + rows.shape[0]] = s
    return q, scale[None, :]


def quantize_rows_torch(x: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """x [M, H] -> (e4m3 [rows, H], float32 [rows, 1]) with per-row scales, zero rows (scale 1) below M."""
    m = x.shape[0]
    s = e4m3_scale(x.abs().amax(dim=1, keepdim=True))
    xq = F.pad(x.float() / s, (0, 0, 0, rows - m)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq, F.pad(s, (0, 0, 0, rows - m), value=1.0)


def _check(x: Tensor, wq: Tensor, w_scale: Tensor, vocab: int) -> None:
    if x.dim() != 2 or wq.dim() != 2 or x.shape[1] != wq.shape[1]:
        raise ValueError(f"fp8_head_logits: x [M, H] and wq [Vp, H] must share H, got {tuple(x.shape)} and {tuple(wq.shape)}")
    if wq.dtype != torch.float8_e4m3fn or w_scale.shape != (1, wq.shape[0]) or w_scale.dtype != torch.float32:
        raise ValueError("fp8_head_logits: wq and w_scale must come from quantize_head (float8_e4m3fn, float32 [1, Vp])")
    if not 1 <= vocab <= wq.shape[0]:
        raise ValueError(f"fp8_head_logits: vocab {vocab} is outside [1, {wq.shape[0]}]")


def fp8_head_logits_reference(x: Tensor, wq: Tensor, w_scale: Tensor, vocab: int) -> Tensor:
    """The function of ``fp8_head_logits`` in float32: e4m3-rounded rows of x times the dequantized weights."""
    _check(x, wq, w_scale, vocab)
    xr = fp8_round_rows(x.float())
    w = wq[:vocab].float() * w_scale[0, :vocab, None]
    return (xr @ w.t()).to(x.dtype)


def fp8_head_unsupported_reason(x: Tensor, wq: Tensor) -> str | None:
    """None when ``fp8_head_logits`` runs ``torch._scaled_mm`` for these inputs, else why not."""
    if not (x.is_cuda and wq.is_cuda and x.device == wq.device):
        return "the inputs are not on one CUDA device"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}; the FP8 GEMM writes bfloat16 or float16"
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return "FP8 GEMMs need compute capability 8.9 or newer"
    if x.shape[1] % _ALIGN or wq.shape[0] % _ALIGN:
        return f"H = {x.shape[1]} and Vp = {wq.shape[0]} must be multiples of {_ALIGN}"
    return None


def fp8_head_logits(x: Tensor, wq: Tensor, w_scale: Tensor, vocab: int, quantize_rows: QuantizeRows | None = None) -> Tensor:
    """x [M, H] -> logits [M, vocab] in x's dtype through ``torch._scaled_mm`` (module docstring)."""
    _check(x, wq, w_scale, vocab)
    reason = fp8_head_unsupported_reason(x, wq)
    if reason is not None:
        if x.is_cuda:
            warn_fallback("fp8_head_logits", reason)
        return fp8_head_logits_reference(x, wq, w_scale, vocab)
    return scaled_mm_logits(x, wq, w_scale, vocab, quantize_rows)


def scaled_mm_logits(x: Tensor, wq: Tensor, w_scale: Tensor, vocab: int, quantize_rows: QuantizeRows | None = None) -> Tensor:
    """``fp8_head_logits``'s GEMM without its checks, for a caller that checked once
    (``fp8_head_unsupported_reason``): the per-step path of ``vllm_plugin/runtime/draft_head.py``."""
    m = x.shape[0]
    xq, sa = (quantize_rows or quantize_rows_torch)(x, _round_up(max(m, 1), _ALIGN))
    out = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=w_scale, out_dtype=x.dtype)[:m]
    return out if vocab == wq.shape[0] else out[:, :vocab].contiguous()

"""The DFlash drafter's logits through an FP8 copy of the lm_head (tfm option ``draft_lm_head: "fp8"``).

The drafter's marginals are one GEMM of R x D rows against the lm_head it shares with the target: at the
Qwen3.6-27B shape 2.54 GB of bfloat16 read per step, 0.94 ms of a 25 ms batch-1 step on an H100 (bench/NOTES.md
section 64). The drafts only propose and the target verifies every token with its own bfloat16 lm_head, so the
marginals may come from an e4m3 copy with one scale per vocabulary row (``vllm_tfm.kernels.fp8_head``), made
once at load (1.27 GB more GPU memory at that shape, counted before vLLM sizes its KV cache). Activations are
quantized per row by vLLM's one-kernel ``scaled_fp8_quant``.

Refused at load, in one line, where the copy would not compute vLLM's ``compute_logits``: a quantized lm_head, a
``head_dtype`` other than the model's, logit soft-capping or scaling, a drafter vocabulary mapping
(``draft_id_to_target_id``), tensor parallelism (the head is vocabulary-split), or a GPU or shape where
``torch._scaled_mm`` with row-wise scales cannot run (compute capability below 8.9, H not a multiple of 16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from vllm_tfm.kernels.fp8_head import fp8_head_unsupported_reason, quantize_head, scaled_mm_logits

__all__ = ["fp8_draft_head"]


def _refuse(why: str) -> ValueError:
    return ValueError(f"tfm option draft_lm_head='fp8': {why}")


@torch.no_grad()
def fp8_draft_head(drafter: Any, dtype: torch.dtype, tp_size: int) -> Callable[[Tensor], Tensor]:
    """hidden [M, H] -> logits [M, vocab]: ``drafter.compute_logits`` with the lm_head read in FP8 (module
    docstring). ``drafter``: vLLM's DFlash model (its ``lm_head`` and ``logits_processor``)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if tp_size != 1:
        raise _refuse(f"runs on one GPU; this engine has tensor_parallel_size {tp_size}")
    lm_head, processor = drafter.lm_head, drafter.logits_processor
    if not isinstance(lm_head.quant_method, UnquantizedEmbeddingMethod):
        raise _refuse(f"the lm_head is quantized ({type(lm_head.quant_method).__name__})")
    if getattr(drafter, "draft_id_to_target_id", None) is not None:
        raise _refuse("the drafter maps its own vocabulary (draft_id_to_target_id)")
    if processor.soft_cap is not None or processor.scale != 1.0:
        raise _refuse(f"the logits are soft-capped or scaled (soft_cap {processor.soft_cap}, scale {processor.scale})")
    if processor.head_dtype not in (None, dtype):
        raise _refuse(f"head_dtype {processor.head_dtype} is not the model's {dtype}")
    vocab = int(processor.org_vocab_size)
    weight = lm_head.weight
    if weight.dtype != dtype or weight.shape[0] < vocab:
        raise _refuse(f"the lm_head weight is {weight.dtype} {tuple(weight.shape)}, not {dtype} with {vocab} rows")
    reason = fp8_head_unsupported_reason(weight[:1], weight[:0])  # device, dtype, GPU, H: before the copy
    if reason is not None:
        raise _refuse(reason)
    wq, w_scale = quantize_head(weight[:vocab])  # its rows padded to a multiple of 16, as _scaled_mm needs

    def quantize_rows(x: Tensor, rows: int) -> tuple[Tensor, Tensor]:  # vLLM's per-token kernel, rows padded
        return ops.scaled_fp8_quant(x, num_token_padding=rows, use_per_token_if_dynamic=True)

    def logits(hidden: Tensor) -> Tensor:  # checked above, once: no per-step validation
        return scaled_mm_logits(hidden, wq, w_scale, vocab, quantize_rows)

    return logits

"""The DFlash drafter's logits through its own head: an FP8 copy of the lm_head (tfm option
``draft_lm_head: "fp8"``) and / or the lm_head's rows of a draft vocabulary (``draft_vocab``).

The drafter's marginals are one GEMM of R x D rows against the lm_head it shares with the target: at the
Qwen3.6-27B shape 2.54 GB of bfloat16 read per step, 0.94 ms of a 25 ms batch-1 step on an H100 (bench/NOTES.md
section 64). The drafts only propose and the target verifies every token with its own bfloat16 lm_head, so the
marginals may come from a cheaper head:

* ``draft_lm_head: "fp8"``: an e4m3 copy with one scale per vocabulary row (``vllm_tfm.kernels.fp8_head``), made
  once at load (1.27 GB more GPU memory at that shape, counted before vLLM sizes its KV cache); activations are
  quantized per row by vLLM's one-kernel ``scaled_fp8_quant``;
* ``draft_vocab``: the rows of the draft vocabulary's N tokens only (``vllm_tfm.models.draft_vocab``, FR-Spec),
  copied once (N x H), the logits of every other token -inf in the [M, vocab] row the consumers read; with
  ``draft_lm_head: "fp8"`` the copy of those rows is the FP8 one.

Refused at load, in one line, where the head would not compute vLLM's ``compute_logits`` on its tokens: a
quantized lm_head, a ``head_dtype`` other than the model's, logit soft-capping or scaling, a drafter vocabulary
mapping (``draft_id_to_target_id``), tensor parallelism (the head is vocabulary-split), or, for FP8, a GPU or shape
where ``torch._scaled_mm`` with row-wise scales cannot run (compute capability below 8.9, H not a multiple of 16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_tfm.kernels.fp8_head import fp8_head_unsupported_reason, quantize_head, scaled_mm_logits
from vllm_tfm.models.draft_vocab import expand_subset_logits

__all__ = ["draft_logits_head"]


@torch.no_grad()
def draft_logits_head(drafter: Any, dtype: torch.dtype, tp_size: int, fp8: bool,
                      token_ids: Tensor | None) -> Callable[[Tensor], Tensor] | None:
    """hidden [M, H] -> logits [M, vocab]: ``drafter.compute_logits`` with the lm_head read in FP8 (``fp8``) and /
    or at ``token_ids`` only (-inf at the other tokens); None when neither is asked for (module docstring).
    ``drafter``: vLLM's DFlash model (its ``lm_head`` and ``logits_processor``)."""
    if not fp8 and token_ids is None:
        return None
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    asked = " and ".join(x for x in ("draft_lm_head='fp8'" if fp8 else "", "draft_vocab" if token_ids is not None else "") if x)

    def refuse(why: str) -> ValueError:
        return ValueError(f"tfm option {asked}: {why}")

    if tp_size != 1:
        raise refuse(f"runs on one GPU; this engine has tensor_parallel_size {tp_size}")
    lm_head, processor = drafter.lm_head, drafter.logits_processor
    if not isinstance(lm_head.quant_method, UnquantizedEmbeddingMethod):
        raise refuse(f"the lm_head is quantized ({type(lm_head.quant_method).__name__})")
    if getattr(drafter, "draft_id_to_target_id", None) is not None:
        raise refuse("the drafter maps its own vocabulary (draft_id_to_target_id)")
    if processor.soft_cap is not None or processor.scale != 1.0:
        raise refuse(f"the logits are soft-capped or scaled (soft_cap {processor.soft_cap}, scale {processor.scale})")
    if processor.head_dtype not in (None, dtype):
        raise refuse(f"head_dtype {processor.head_dtype} is not the model's {dtype}")
    vocab = int(processor.org_vocab_size)
    weight = lm_head.weight
    if weight.dtype != dtype or weight.shape[0] < vocab:
        raise refuse(f"the lm_head weight is {weight.dtype} {tuple(weight.shape)}, not {dtype} with {vocab} rows")
    ids = None
    if token_ids is not None:
        ids = token_ids.to(device=weight.device, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise refuse(f"the draft vocabulary must be token ids in 0..{vocab - 1}")
    if fp8:
        reason = fp8_head_unsupported_reason(weight[:1], weight[:0])  # device, dtype, GPU, H: before the copy
        if reason is not None:
            raise refuse(reason)
    rows = weight[:vocab] if ids is None else weight.index_select(0, ids)  # the draft vocabulary's rows: a copy
    n = int(rows.shape[0])
    if fp8:
        from vllm import _custom_ops as ops

        wq, w_scale = quantize_head(rows)  # its rows padded to a multiple of 16, as _scaled_mm needs
        del rows

        def quantize_rows(x: Tensor, m: int) -> tuple[Tensor, Tensor]:  # vLLM's per-token kernel, rows padded
            return ops.scaled_fp8_quant(x, num_token_padding=m, use_per_token_if_dynamic=True)

        def head(hidden: Tensor) -> Tensor:  # checked above, once: no per-step validation
            return scaled_mm_logits(hidden, wq, w_scale, n, quantize_rows)
    else:
        def head(hidden: Tensor) -> Tensor:
            return F.linear(hidden, rows)

    if ids is None:
        return head

    def logits(hidden: Tensor) -> Tensor:  # the consumers read full-vocabulary rows: -inf outside the subset
        return expand_subset_logits(head(hidden), ids, vocab)

    return logits

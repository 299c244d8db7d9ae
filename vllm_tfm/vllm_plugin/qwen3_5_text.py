"""Text-only Qwen3.5 / Qwen3.6 as hybrid (GDN + gated attention) models for vLLM 0.26.

vLLM 0.26 registers Qwen3.5 only through its vision-language classes
(``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``); its text classes
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` lack ``IsHybrid`` and the class methods that
size the GDN state cache, so a text-only checkpoint (transformers' ``Qwen3_5TextConfig``,
``architectures: ["Qwen3_5ForCausalLM"]``) cannot be served. These subclasses add ``IsHybrid``
and take the VL class's three mamba-state class methods (the same GDN layers, so the same shapes,
dtypes and copy functions).

This module imports vLLM model code: it is registered lazily ("module:Class", see
``models_registry``) and imported only where vLLM loads or inspects the model.
"""

from __future__ import annotations

from vllm.model_executor.models.interfaces import IsHybrid
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
)

__all__ = ["Qwen3_5TextForCausalLM", "Qwen3_5MoeTextForCausalLM"]

_VL = Qwen3_5ForConditionalGeneration


class Qwen3_5TextForCausalLM(Qwen3_5ForCausalLM, IsHybrid):
    """Text-only dense Qwen3.5 with the GDN state-cache hooks of the VL class."""

    get_mamba_state_dtype_from_config = classmethod(_VL.get_mamba_state_dtype_from_config.__func__)
    get_mamba_state_shape_from_config = classmethod(_VL.get_mamba_state_shape_from_config.__func__)
    get_mamba_state_copy_func = classmethod(_VL.get_mamba_state_copy_func.__func__)


class Qwen3_5MoeTextForCausalLM(Qwen3_5MoeForCausalLM, IsHybrid):
    """Text-only MoE Qwen3.5 with the same hooks (the MoE VL class inherits them from ``_VL``)."""

    get_mamba_state_dtype_from_config = classmethod(_VL.get_mamba_state_dtype_from_config.__func__)
    get_mamba_state_shape_from_config = classmethod(_VL.get_mamba_state_shape_from_config.__func__)
    get_mamba_state_copy_func = classmethod(_VL.get_mamba_state_copy_func.__func__)

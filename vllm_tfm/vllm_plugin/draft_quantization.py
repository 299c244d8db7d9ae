"""A tfm drafter quantized at load by vLLM's online methods (``"quantization": "fp8"`` in the speculative config).

vLLM 0.26 builds a drafter's quantization config in the worker (``get_draft_quant_config``,
``model_executor/models/utils.py``) through ``get_quant_config`` (``model_executor/model_loader/weight_utils.py``).
For a checkpoint without a ``quantization_config`` that function looks for an override file or JSON in
``model_config.hf_overrides`` and refuses anything but a dict there ("hf_overrides must be a dict for
get_quant_config to get the quantization config from it"). A draft model config's ``hf_overrides`` is always a
callable (``SpeculativeConfig.compose_draft_hf_overrides``), so every online quantization of an unquantized
drafter fails at load: on the GPU host, ``quantization: "fp8"`` with the 27B-shaped DFlash drafter did
(bench/NOTES.md section 63). Known upstream: vllm-project/vllm pull requests #52396 and #53881 (open), which
read a callable override as "no override" too.

Patched here, once per process (``patching``): for the draft model config of a tfm engine (its Hugging Face
config carries the tfm options, ``options.HF_OPTIONS_ATTR``) with a callable ``hf_overrides``, the original
runs on a shallow copy whose ``hf_overrides`` is empty. A callable carries no override file or JSON, so the
original goes on as for a plain model: the checkpoint's own config when it has one (read before the override
check, unchanged), else the online methods (``fp8``: per-tensor FP8 weights, activations scaled per call).
Every other model config goes to the original unchanged. Methods that need a config file (AWQ, GPTQ, ...) on
an unquantized drafter are refused at config time (``drafter_checks.check_drafter_quantization``).

The context K/V projection of a quantized drafter (``repair_context_kv_projection``). vLLM 0.26's DFlash model
(``model_executor/models/qwen3_dflash.py``, ``_build_context_kv_buffers``) projects every step's context rows
for all layers in one GEMM against ``torch.cat`` of the layers' raw ``qkv_proj.weight[q_size:]`` slices, which
assumes bfloat16 [out, in] weights. Online FP8 leaves each weight as float8 [in, out] with a scale, so that GEMM
failed in the profile run on the GPU host ("mat1 and mat2 shapes cannot be multiplied (4096x5120 and
6144x5120)", bench/NOTES.md section 64); vLLM's own DFlash has the same fault. After the drafter is loaded the
proposer rebuilds that fused weight from what each quantized layer computes: the layer's quantization method
applied to the identity rows (one-hot rows quantize exactly under per-token or per-tensor activation scales)
gives its dequantized weight, transposed, for any method and weight layout. The fused projection then runs in
the model's dtype on the dequantized values, which is what the quantized layers represent; the query rows keep
the layers' own quantized GEMMs.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .options import HF_OPTIONS_ATTR
from .patching import replace_attribute

__all__ = ["install_draft_quantization", "is_tfm_draft_config", "repair_context_kv_projection", "dequantized_weight"]

logger = logging.getLogger("vllm.tfm")


def is_tfm_draft_config(model_config: Any) -> bool:
    """The draft model config of a tfm engine: its Hugging Face config carries the tfm options."""
    return getattr(getattr(model_config, "hf_config", None), HF_OPTIONS_ATTR, None) is not None


def _make_get_quant_config(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_quant_config(model_config: Any, load_config: Any) -> Any:
        overrides = getattr(model_config, "hf_overrides", None)
        if callable(overrides) and is_tfm_draft_config(model_config):
            plain = copy.copy(model_config)  # the caller's config keeps its callable
            object.__setattr__(plain, "hf_overrides", {})
            return original(plain, load_config)
        return original(model_config, load_config)

    return get_quant_config


def install_draft_quantization() -> None:
    """Patch ``weight_utils.get_quant_config`` (module docstring); idempotent. ``VllmConfig`` imports it at each
    call, so the patched function is the one the drafter's quantization config comes from."""
    from vllm.model_executor.model_loader import weight_utils

    replace_attribute(weight_utils, "get_quant_config", _make_get_quant_config,
                      reason="a tfm drafter's callable hf_overrides read as no override (vLLM 0.26 refuses any "
                             "non-dict, so no unquantized drafter could be quantized at load)")


def _is_quantized(linear: Any) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    method = getattr(linear, "quant_method", None)
    return method is not None and not isinstance(method, UnquantizedLinearMethod)


@torch.no_grad()
def dequantized_weight(linear: Any, dtype: torch.dtype) -> Tensor:
    """[out, in] in ``dtype``: what a vLLM linear layer's quantization method multiplies by, read by applying the
    method to the identity rows (no bias). ``input_size_per_partition`` rows, in chunks of 1024."""
    n_in = int(linear.input_size_per_partition)
    device = next(p.device for p in linear.parameters())
    cols = []
    for start in range(0, n_in, 1024):
        rows = min(1024, n_in - start)
        eye = torch.zeros(rows, n_in, dtype=dtype, device=device)
        eye[torch.arange(rows, device=device), torch.arange(start, start + rows, device=device)] = 1
        cols.append(linear.quant_method.apply(linear, eye, None))
    return torch.cat(cols).t().contiguous()


def repair_context_kv_projection(drafter: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Rebuild the DFlash drafter's fused context K/V weight from its quantized layers (module docstring).
    Returns False, changing nothing, when no layer's ``qkv_proj`` is quantized."""
    inner = getattr(drafter, "model", drafter)
    if not hasattr(inner, "_build_fused_kv_buffers"):  # no fused context projection in this drafter model
        return False
    attns = [layer.self_attn for layer in inner.layers]
    if not any(_is_quantized(a.qkv_proj) for a in attns):
        return False
    if not hasattr(inner, "_num_attn_layers"):  # dummy weights: vLLM builds these lazily at the first step
        inner._build_fused_kv_buffers()
    kv = [dequantized_weight(a.qkv_proj, dtype)[a.q_size:] for a in attns]
    inner._fused_kv_weight = torch.cat(kv).contiguous()
    method = type(attns[0].qkv_proj.quant_method).__name__
    logger.info("vllm-tfm: the drafter's %d layers are quantized (%s); its fused context K/V projection "
                "[%d, %d] is rebuilt from their dequantized weights", len(attns), method, *inner._fused_kv_weight.shape)
    return True

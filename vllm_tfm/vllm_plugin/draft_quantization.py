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

The context K/V projection of a quantized DFlash drafter. vLLM 0.26's DFlash model
(``model_executor/models/qwen3_dflash.py``, ``DFlashQwen3Model._build_context_kv_buffers``) projects every step's
context rows for all layers in one GEMM against ``torch.cat`` of the layers' raw ``qkv_proj.weight[q_size:]``
slices, which assumes unquantized [out, in] weights. Online FP8 leaves each weight float8 [in, out] with a scale, so
that GEMM failed in the profile run on the GPU host ("mat1 and mat2 shapes cannot be multiplied (4096x5120 and
6144x5120)", bench/NOTES.md section 64), for vLLM's own DFlash as well. Patched here: after the original builds
its buffers, a drafter whose ``qkv_proj`` layers are quantized gets the fused weight rebuilt from what each layer
computes (``dequantized_weight``: the layer's quantization method applied to identity rows, which quantize exactly
under per-token or per-tensor activation scales), for any method and weight layout, on every build (at load, lazily
after dummy weights, on a reload). The fused projection then runs in the model's dtype on the dequantized values;
the query rows keep the layers' own quantized GEMMs. Unquantized drafters get the original's buffers unchanged.
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

__all__ = ["install_draft_quantization", "is_tfm_draft_config", "dequantized_weight"]

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
    """Patch ``weight_utils.get_quant_config`` and ``DFlashQwen3Model._build_context_kv_buffers`` (module
    docstring); idempotent. ``VllmConfig`` imports ``get_quant_config`` at each call, so the patched function is
    the one the drafter's quantization config comes from."""
    from vllm.model_executor.model_loader import weight_utils
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    replace_attribute(weight_utils, "get_quant_config", _make_get_quant_config,
                      reason="a tfm drafter's callable hf_overrides read as no override (vLLM 0.26 refuses any "
                             "non-dict, so no unquantized drafter could be quantized at load)")
    replace_attribute(DFlashQwen3Model, "_build_context_kv_buffers", _make_build_context_kv_buffers,
                      reason="the fused context K/V weight of a quantized DFlash drafter from its dequantized layers "
                             "(vLLM 0.26 concatenates the raw quantized weights)")


def _is_quantized(linear: Any) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    method = getattr(linear, "quant_method", None)
    return method is not None and not isinstance(method, UnquantizedLinearMethod)


@torch.no_grad()
def dequantized_weight(linear: Any) -> Tensor:
    """[out, in] in the layer's ``params_dtype``: what a vLLM linear layer's quantization method multiplies by,
    read by applying the method to the identity rows (no bias). ``input_size_per_partition`` rows, in chunks of
    1024."""
    n_in, dtype = int(linear.input_size_per_partition), linear.params_dtype
    device = next(p.device for p in linear.parameters())
    cols = []
    for start in range(0, n_in, 1024):
        rows = min(1024, n_in - start)
        eye = torch.zeros(rows, n_in, dtype=dtype, device=device)
        eye[torch.arange(rows, device=device), torch.arange(start, start + rows, device=device)] = 1
        cols.append(linear.quant_method.apply(linear, eye, None))
    return torch.cat(cols).t().contiguous()


def _make_build_context_kv_buffers(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _build_context_kv_buffers(self: Any, layers_attn: list[Any], has_bias: bool) -> None:
        original(self, layers_attn, has_bias)
        if not any(_is_quantized(a.qkv_proj) for a in layers_attn):
            return
        self._fused_kv_weight = torch.cat([dequantized_weight(a.qkv_proj)[a.q_size:] for a in layers_attn]).contiguous()
        logger.info("vllm-tfm: the DFlash drafter's %d layers are quantized (%s); its fused context K/V projection "
                    "[%d, %d] is built from their dequantized weights", len(layers_attn),
                    type(layers_attn[0].qkv_proj.quant_method).__name__, *self._fused_kv_weight.shape)

    return _build_context_kv_buffers

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
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

from .options import HF_OPTIONS_ATTR
from .patching import replace_attribute

__all__ = ["install_draft_quantization", "is_tfm_draft_config"]


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

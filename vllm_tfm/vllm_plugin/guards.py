"""What method 'tfm' refuses, at config time and per request, each with one clear line.

Config time (the process that builds the engine config, from ``config_patch``):

* targets outside :data:`SUPPORTED_TARGET_ARCHITECTURES`, non-generate runners, a GDN target that
  vLLM does not see as hybrid (the model registration did not run);
* pipeline parallelism > 1 (drafts exist only on the last PP rank in vLLM 0.26);
* ``VLLM_USE_V2_MODEL_RUNNER=1`` (tfm hooks the V1 runner; V2 knows no 'tfm');
* prefix caching / ``mamba_cache_mode`` other than ``none`` on a hybrid target (the GDN commit
  replays the accepted path into vLLM's own state slots; ``align`` mode copies them itself);
* vLLM sampling knobs that have a tree meaning of their own: ``draft_sample_method``,
  ``rejection_sample_method`` and the synthetic rates (use the tfm option ``sampling``), the
  per-batch-size dynamic budget, heterogeneous vocabularies.

The target's attention backend is set to ``TRITON_ATTN`` when left unset (any other is refused):
the runtime's tree-masked attention replaces that backend. CUDA graph settings (which cudagraph
modes tfm runs, its default mode and capture sizes) are decided in ``cuda_graphs``, asynchronous
scheduling (vLLM's default at tensor parallelism 1, synchronous above) in ``async_scheduling``.

Per request (``SamplingParams._validate_spec_decode``, run by vLLM's input processor before a
request reaches the engine, so the client gets an HTTP 400): structured output, prompt logprobs,
and the output-history penalties / bad words, which are defined on a chain of previous tokens and
would differ between the branches of a tree. vLLM's own check runs first and refuses ``min_p`` and
``logit_bias`` for every speculative method. The complete request-parameter matrix (trees, chain
verification through vLLM's sampler, or refusal) is docs/guarantees.md, checked row by row by
tests/cpu/test_request_matrix.py.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from .patching import replace_attribute

__all__ = [
    "TFM_METHOD",
    "SUPPORTED_TARGET_ARCHITECTURES",
    "HYBRID_TARGET_ARCHITECTURES",
    "REFUSED_SPEC_KEYS",
    "check_spec_keys",
    "check_target",
    "check_model_runner_env",
    "check_engine_args",
    "unsupported_request_feature",
    "install_request_guard",
]

logger = logging.getLogger("vllm_tfm")

TFM_METHOD = "tfm"

SUPPORTED_TARGET_ARCHITECTURES: Mapping[str, str] = {
    "Qwen3_5ForConditionalGeneration": "Qwen3.5 / Qwen3.6 dense (hub checkpoints; text path of the VL class)",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5 / Qwen3.6 MoE (hub checkpoints; same GDN layer)",
    "Qwen3_5ForCausalLM": "text-only Qwen3.5 dense, registered hybrid by vllm-tfm",
    "Qwen3_5MoeForCausalLM": "text-only Qwen3.5 MoE, registered hybrid by vllm-tfm",
    "Qwen3NextForCausalLM": "Qwen3-Next (same QwenGatedDeltaNetAttention layer)",
    "Qwen3ForCausalLM": "pure-attention Qwen3 (no GDN: exercises the tree attention path alone)",
}
"""Targets whose vLLM class has ``set_aux_hidden_state_layers`` (DFlash taps) and whose linear
attention, if any, is ``QwenGatedDeltaNetAttention`` (the layer the GDN tree hook replaces)."""

HYBRID_TARGET_ARCHITECTURES = frozenset(a for a in SUPPORTED_TARGET_ARCHITECTURES if a != "Qwen3ForCausalLM")

_REFUSED_SPEC_VALUES: Mapping[str, tuple[Any, str]] = {
    # key: (the only accepted value, what to use instead)
    "draft_sample_method": ("greedy", "tree acceptance is set by the tfm option 'sampling'"),
    "rejection_sample_method": ("standard", "tree acceptance is set by the tfm option 'sampling'"),
    "synthetic_acceptance_rates": (None, "synthetic acceptance is a chain feature"),
    "synthetic_acceptance_length": (None, "synthetic acceptance is a chain feature"),
    "num_speculative_tokens_per_batch_size": (None, "the tree budget is num_speculative_tokens"),
    "use_heterogeneous_vocab": (False, "DFlash drafts are target token ids"),
}

REFUSED_SPEC_KEYS: tuple[str, ...] = tuple(_REFUSED_SPEC_VALUES)


def check_spec_keys(spec: Mapping[str, Any]) -> None:
    """Refuse speculative-config keys whose chain meaning does not carry over to trees."""
    for key, (accepted, instead) in _REFUSED_SPEC_VALUES.items():
        if key in spec and spec[key] != accepted:
            raise ValueError(f"speculative_config: {key}={spec[key]!r} is not supported with method 'tfm' ({instead})")


def check_target(target_model_config: Any, target_parallel_config: Any) -> None:
    """Refuse targets and parallel layouts tfm cannot run."""
    arch = getattr(target_model_config, "architecture", None)
    if arch not in SUPPORTED_TARGET_ARCHITECTURES:
        raise ValueError(
            f"method 'tfm' does not support the target architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_TARGET_ARCHITECTURES)})"
        )
    runner = getattr(target_model_config, "runner_type", "generate")
    if runner != "generate":
        raise ValueError(f"method 'tfm' needs a generate model, but the target runs as {runner!r}")
    if arch in HYBRID_TARGET_ARCHITECTURES and not getattr(target_model_config, "is_hybrid", False):
        raise ValueError(
            f"target {arch} is not registered as a hybrid (GDN) model in vLLM; is the vllm-tfm plugin loaded "
            "(vllm_tfm.register())?"
        )
    pp = getattr(target_parallel_config, "pipeline_parallel_size", 1)
    if pp > 1:
        raise ValueError(f"method 'tfm' does not support pipeline parallelism (pipeline_parallel_size={pp}); use tensor parallelism")


def check_model_runner_env() -> None:
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError("method 'tfm' runs on vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER (it is 1)")


def check_engine_args(engine_args: Any, target_model_config: Any) -> None:
    """Engine-wide settings (from ``EngineArgs``); CUDA graphs: ``cuda_graphs.configure_engine_graphs``."""
    if getattr(target_model_config, "is_hybrid", False):
        if getattr(engine_args, "enable_prefix_caching", None) is True:
            raise ValueError(
                "method 'tfm' does not support prefix caching on a hybrid (GDN) target; drop enable_prefix_caching=True"
            )
        mode = getattr(engine_args, "mamba_cache_mode", "none")
        if mode not in (None, "none"):
            raise ValueError(f"method 'tfm' needs mamba_cache_mode='none' on a hybrid (GDN) target, got {mode!r}")
    _check_attention_backend(engine_args)


TARGET_ATTENTION_BACKEND = "TRITON_ATTN"
"""The tree-masked attention of the runtime replaces vLLM's TRITON_ATTN backend."""


def _backend_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "name", value)).upper()


def _check_attention_backend(engine_args: Any) -> None:
    """The target must run TRITON_ATTN; select it when the user left the backend unset."""
    direct = _backend_name(getattr(engine_args, "attention_backend", None))
    config = getattr(engine_args, "attention_config", None)
    nested = _backend_name(config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None))
    chosen = direct or nested
    if chosen in (None, "AUTO"):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        logger.warning("vllm-tfm: method 'tfm' uses tree-masked TRITON_ATTN; setting attention_backend=TRITON_ATTN")
        engine_args.attention_backend = AttentionBackendEnum[TARGET_ATTENTION_BACKEND]
    elif chosen != TARGET_ATTENTION_BACKEND:
        raise ValueError(
            f"method 'tfm' needs attention_backend={TARGET_ATTENTION_BACKEND} for the target (tree-masked attention), got {chosen}"
        )


_REQUEST_FEATURES: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("structured output", lambda p: p.structured_outputs is not None),
    ("prompt_logprobs", lambda p: p.prompt_logprobs is not None),
    ("presence_penalty", lambda p: p.presence_penalty != 0.0),
    ("frequency_penalty", lambda p: p.frequency_penalty != 0.0),
    ("repetition_penalty", lambda p: p.repetition_penalty != 1.0),
    ("bad_words", lambda p: bool(p.bad_words)),
)
"""Request features refused with method 'tfm'. Remove an entry once the runtime supports it."""


def unsupported_request_feature(params: Any) -> str | None:
    """The first refused feature a SamplingParams asks for, or None."""
    for name, asks in _REQUEST_FEATURES:
        if asks(params):
            return name
    return None


def _make_validate_spec_decode(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def _validate_spec_decode(self: Any, speculative_config: Any) -> None:
        original(self, speculative_config)
        if speculative_config is None or getattr(speculative_config, "method", None) != TFM_METHOD:
            return
        feature = unsupported_request_feature(self)
        if feature is not None:
            raise ValueError(f"{feature} is not supported with speculative method 'tfm'")

    return _validate_spec_decode


def install_request_guard() -> bool:
    """Wrap ``SamplingParams._validate_spec_decode`` (vLLM 0.26 ``sampling_params.py``)."""
    from vllm.sampling_params import SamplingParams

    return replace_attribute(
        SamplingParams,
        "_validate_spec_decode",
        _make_validate_spec_decode,
        reason="refuse request features a token tree cannot honour (structured output, prompt logprobs, penalties)",
    )

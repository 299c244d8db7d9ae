"""Model architectures vllm-tfm registers with vLLM's ``ModelRegistry`` (all processes).

Registration is lazy ("module:Class" strings): nothing here imports vLLM model code, so
registering is cheap and never initialises CUDA; vLLM imports the class where it inspects
(a subprocess) or loads the model. The vision-language Qwen3.5 classes stay as vLLM has them.

vLLM 0.26 also keys per-architecture config hooks by name (``MODELS_CONFIG_MAP`` in
``vllm/model_executor/models/config.py``): the one for ``Qwen3_5ForConditionalGeneration`` sets the
GDN state dtype from the checkpoint's ``mamba_ssm_dtype`` (how a Qwen3.5 checkpoint asks for a
float32 state). Without an entry for the text-only names, a text-only checkpoint would keep its GDN
state in the model dtype (bf16), silently unlike the same weights under the VL class. We map the
text-only names to the same hook.
"""

from __future__ import annotations

from collections.abc import Mapping

from .patching import record_patch

__all__ = ["TEXT_QWEN3_5_CONFIG_HOOKS", "TEXT_QWEN3_5_MODELS", "register_config_hooks", "register_models"]

_MODULE = "vllm_tfm.vllm_plugin.qwen3_5_text"

TEXT_QWEN3_5_MODELS: Mapping[str, str] = {
    "Qwen3_5ForCausalLM": f"{_MODULE}:Qwen3_5TextForCausalLM",
    "Qwen3_5MoeForCausalLM": f"{_MODULE}:Qwen3_5MoeTextForCausalLM",
}
"""Architecture name in a checkpoint's config.json -> our hybrid class."""

TEXT_QWEN3_5_CONFIG_HOOKS: Mapping[str, str] = {
    "Qwen3_5ForCausalLM": "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForConditionalGeneration",
}
"""Text-only architecture -> the VL architecture whose vLLM config hook it shares."""


def _is_ours(entry: object, target: str) -> bool:
    module, _, cls = target.partition(":")
    return getattr(entry, "module_name", None) == module and getattr(entry, "class_name", None) == cls


def register_models() -> list[str]:
    """Register the text-only Qwen3.5 architectures; returns those registered now (idempotent)."""
    from vllm import ModelRegistry

    models = ModelRegistry.models
    done = []
    for arch, target in TEXT_QWEN3_5_MODELS.items():
        previous = models.get(arch)
        if _is_ours(previous, target):
            continue
        ModelRegistry.register_model(arch, target)

        def undo(arch: str = arch, previous: object = previous) -> None:
            if previous is None:
                models.pop(arch, None)
            else:
                models[arch] = previous

        record_patch(f"vllm ModelRegistry[{arch}]", previous, models[arch], reason="text-only Qwen3.5 as hybrid", undo=undo)
        done.append(arch)
    return done


def register_config_hooks() -> list[str]:
    """Give the text-only Qwen3.5 names the VL classes' entries in vLLM's ``MODELS_CONFIG_MAP``
    (idempotent; never replaces an entry vLLM itself defines). Returns the names added now."""
    from vllm.model_executor.models import config as model_configs

    table = model_configs.MODELS_CONFIG_MAP
    done = []
    for text_arch, vl_arch in TEXT_QWEN3_5_CONFIG_HOOKS.items():
        hook = table.get(vl_arch)
        if hook is None:
            raise RuntimeError(
                f"vllm_tfm: vLLM has no config hook for {vl_arch} (MODELS_CONFIG_MAP); this vLLM is not the 0.26 we support"
            )
        previous = table.get(text_arch)
        if previous is hook:
            continue
        if previous is not None:  # vLLM defines its own: keep it
            continue
        table[text_arch] = hook

        def undo(arch: str = text_arch) -> None:
            table.pop(arch, None)

        record_patch(
            f"vllm MODELS_CONFIG_MAP[{text_arch}]", None, hook,
            reason="text-only Qwen3.5 uses the checkpoint's mamba_ssm_dtype like the VL class", undo=undo,
        )
        done.append(text_arch)
    return done

"""Model architectures vllm-tfm registers with vLLM's ``ModelRegistry`` (all processes).

Registration is lazy ("module:Class" strings): nothing here imports vLLM model code, so
registering is cheap and never initialises CUDA; vLLM imports the class where it inspects
(a subprocess) or loads the model. The vision-language Qwen3.5 classes stay as vLLM has them.
"""

from __future__ import annotations

from collections.abc import Mapping

from .patching import record_patch

__all__ = ["TEXT_QWEN3_5_MODELS", "register_models"]

_MODULE = "vllm_tfm.vllm_plugin.qwen3_5_text"

TEXT_QWEN3_5_MODELS: Mapping[str, str] = {
    "Qwen3_5ForCausalLM": f"{_MODULE}:Qwen3_5TextForCausalLM",
    "Qwen3_5MoeForCausalLM": f"{_MODULE}:Qwen3_5MoeTextForCausalLM",
}
"""Architecture name in a checkpoint's config.json -> our hybrid class."""


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

"""``register()``: the ``vllm.general_plugins`` entry point of vllm-tfm (shared/VLLM_HOOKS.md §8).

vLLM calls it in every process it starts (API server / ``LLM``, engine core, workers, Ray actors,
the model-inspection subprocess), and exceptions it raises abort vLLM's start. It is idempotent
(the second call in a process does nothing) and, in order:

1. checks that vLLM is 0.26.x (``version.check_vllm_version``);
2. config patches: ``EngineArgs.create_speculative_config`` and direct ``SpeculativeConfig``
   construction for method "tfm", predicates ``use_eagle`` / ``use_dflash`` / ``compute_hash``
   (``config_patch``), and the per-request guard ``SamplingParams._validate_spec_decode``
   (``guards``), and tfm's asynchronous-scheduling default (``async_scheduling``: vLLM's at tensor
   parallelism 1, synchronous above); applied in every process, they change nothing for other methods;
3. registers the text-only Qwen3.5 architectures as hybrid models (``models_registry``) and
   lets float32 GDN models prefill (``fp32_prefill``; vLLM 0.26's chunk kernel refuses float32);
   keeps ``allowed_token_ids`` masks with their requests when vLLM's input batch moves rows
   (``allowed_token_masks``: two vLLM 0.26 bugs, every engine of the process);
4. calls ``vllm_tfm.vllm_plugin.runtime.install()`` when that package exists (the worker-side
   hooks: proposer, tree sampler, tree attention, GDN tree op, commit).
"""

from __future__ import annotations

import importlib
import logging
import threading

from .version import check_vllm_version

__all__ = ["RUNTIME_MODULE", "register", "is_registered", "install_runtime"]

logger = logging.getLogger("vllm_tfm")

RUNTIME_MODULE = "vllm_tfm.vllm_plugin.runtime"

_LOCK = threading.Lock()
_REGISTERED = False


def install_runtime(module_name: str = RUNTIME_MODULE) -> bool:
    """Import ``module_name`` and call its ``install()``; False when that module does not exist.

    Only the ModuleNotFoundError for ``module_name`` itself is swallowed: a runtime package that
    exists but fails to import raises, and one without ``install()`` raises RuntimeError.
    """
    try:
        runtime = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        logger.debug("vllm-tfm: no %s; config-time support only", module_name)
        return False
    install = getattr(runtime, "install", None)
    if not callable(install):
        raise RuntimeError(f"vllm-tfm: {module_name} exists but has no install() function")
    install()
    return True


def register() -> None:
    """Install vllm-tfm into the running vLLM (idempotent; see the module docstring)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        check_vllm_version()

        from .allowed_token_masks import install_allowed_token_masks
        from .async_scheduling import install_async_scheduling_patches
        from .config_patch import install_config_patches, install_direct_construction, install_predicate_patches
        from .draft_quantization import install_draft_quantization
        from .fp32_prefill import install_fp32_prefill
        from .guards import install_request_guard
        from .models_registry import register_config_hooks, register_models

        install_config_patches()
        install_predicate_patches()
        install_direct_construction()
        install_async_scheduling_patches()
        install_request_guard()
        register_models()
        register_config_hooks()
        install_fp32_prefill()
        install_allowed_token_masks()
        install_draft_quantization()
        install_runtime()
        _REGISTERED = True


def is_registered() -> bool:
    return _REGISTERED


def _forget_registration() -> None:
    """For tests: let the next ``register()`` run again (after ``patching.restore_all()``)."""
    global _REGISTERED
    with _LOCK:
        _REGISTERED = False

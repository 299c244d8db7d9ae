"""vllm-tfm: tree speculative decoding "Trees from Marginals" for hybrid Gated-DeltaNet models.

Importing ``vllm_tfm`` is cheap: it imports neither vLLM nor torch. ``register()`` is the
``vllm.general_plugins`` entry point (pyproject: ``tfm = "vllm_tfm:register"``); vLLM calls it in
every process, and it imports ``vllm_tfm.vllm_plugin`` only then.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "register"]


def register() -> None:
    """vLLM plugin entry point: install method "tfm" into vLLM 0.26 (idempotent)."""
    from vllm_tfm.vllm_plugin.plugin import register as _register

    _register()

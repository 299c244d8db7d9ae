"""Everything of vllm-tfm that touches vLLM 0.26 internals (the only package that imports vLLM).

Config side (this package): ``plugin.register`` (the entry point), ``config_patch`` (method
"tfm" in speculative configs), ``options`` (tree options, and how workers read them),
``drafter_checks`` and ``guards`` (config-time and per-request refusals), ``models_registry`` /
``qwen3_5_text`` (text-only Qwen3.5 as a hybrid model), ``patching`` (the registry of every
replaced vLLM attribute), ``version``. Worker side: ``runtime`` (proposer, tree sampler, tree
attention, GDN tree op, commit), installed by ``register()`` when present.

Importing this package does not import vLLM; ``register()`` does.
"""

from .plugin import register

__all__ = ["register"]

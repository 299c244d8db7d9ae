"""The Ray Serve LLM callback that registers vllm-tfm in the replica (see ``vllm_tfm.serve.replica``).

Loaded by Ray Serve LLM in the replica from ``LLMConfig.callback_config.callback_class``; imports Ray.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase

from .replica import setup_replica

__all__ = ["TfmReplicaCallback"]


class TfmReplicaCallback(CallbackBase):
    """Registers vllm-tfm when Ray Serve LLM builds it (in the replica, before the engine starts)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        setup_replica()

    async def on_before_node_init(self) -> None:
        setup_replica()

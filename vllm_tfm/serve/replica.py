"""vllm-tfm's registration in the Ray Serve replica process.

On GPUs Ray Serve LLM builds the vLLM config in a Ray task and hands it, pickled, to the replica
(``VLLMEngine._prepare_engine_config``, ``requires_remote_initialization``), which starts vLLM's
engine front end, the input processor that validates every request, without ever calling vLLM's
``load_general_plugins()``: only that task, the engine-core process and the workers load the
plugin. Without it the front end accepts request features a token tree cannot honour (penalties,
prompt logprobs, structured output: HTTP 400 under ``vllm serve``, see ``vllm_plugin.guards``),
and the engine serves them with a silently different distribution (seen on the GPU host: a
``prompt_logprobs`` request answered 200 through Ray Serve). The builder therefore names
:data:`CALLBACK_CLASS` as the ``LLMConfig.callback_config`` class: Ray Serve LLM instantiates it
in the replica when the engine starts (``VLLMEngine.start`` runs its ``on_before_node_init``
before it builds the engine), and it registers vllm-tfm there. This module imports neither Ray
nor vLLM; ``replica_callback`` holds the class.
"""

from __future__ import annotations

__all__ = ["CALLBACK_CLASS", "setup_replica"]

CALLBACK_CLASS = "vllm_tfm.serve.replica_callback.TfmReplicaCallback"
"""The ``callback_config.callback_class`` the builder sets (module path + class name)."""


def setup_replica() -> None:
    """Register vllm-tfm with vLLM in this process (the request guard included); idempotent."""
    from vllm_tfm.vllm_plugin import register

    register()

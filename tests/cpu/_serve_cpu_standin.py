"""A CPU STAND-IN for Ray Serve LLM's ``VLLMEngine``, used by tests/cpu/test_ray_serve.py only.

The CPU test machine has no GPU, so no vLLM engine can start there. This class takes the engine's
place inside the Ray Serve LLM replica (through Ray Serve LLM's own engine-class hook, the
``RAYLLM_VLLM_ENGINE_CLS`` environment variable) and keeps everything up to the engine real:

* real: the local Ray cluster, Serve's HTTP proxy, the OpenAI ingress built by
  ``ray.serve.llm.build_openai_app``, the ``LLMServer`` replica and its runtime_env, the
  ``LLMConfig`` made by ``vllm_tfm.serve``; the vLLM engine config, built as on GPUs by Ray Serve
  LLM's own function ``_get_vllm_engine_config`` in a Ray task with the replica's runtime_env (it
  constructs ``AsyncEngineArgs``, so vLLM loads vllm-tfm through its entry point in that task and
  resolves the tree options there, ``VLLM_TFM_*`` from the runtime_env), then handed to the
  replica, which never loads vLLM plugins itself; the per-request check is vLLM's
  ``SamplingParams.verify`` against that config in the replica, where only the LLMConfig's
  callback (``vllm_tfm.serve.replica``), run as ``VLLMEngine.start`` runs it, installed the plugin's
  request guard.
* stood in: token generation. Instead of vLLM's GPU engine, vllm-tfm's reference tree speculative
  decoder (``vllm_tfm.reference``: a ``transformers`` target and the drafter directory) runs with
  the proposal, budget and tree options read back from the built config. Greedy requests only.
  Two shortcuts, both for the 2-core CI machine: vLLM inspects model classes in this process
  instead of a subprocess per class, and the platform's device type is set to "cpu" (vLLM's
  placeholder platform has none) through the ``device_type`` argument Ray's function offers.

On start the replica writes what it saw to the JSON file named by ``TFM_STANDIN_REPORT``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from ray.llm._internal.serve.core.configs.openai_api_models import (
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
)
from ray.llm._internal.serve.core.engine.protocol import LLMEngine

REPORT_ENV = "TFM_STANDIN_REPORT"


def _error(message: str, code: int = 400) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error", code=code))


def build_engine_config(llm_config: Any) -> Any:
    """Ray Serve LLM's own ``_get_vllm_engine_config`` (run as a Ray task, like on GPUs)."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()  # stand-in shortcut (see the module docstring)
    return _get_vllm_engine_config(llm_config, device_type="cpu")[1]


class CpuStandInEngine(LLMEngine):
    """See the module docstring: real Ray Serve + vLLM config path, reference decoder for tokens."""

    def __init__(self, llm_config: Any) -> None:
        self.llm_config = llm_config
        self.vllm_config: Any = None
        self.decoder: Any = None

    async def start(self) -> None:
        from importlib.metadata import entry_points

        import ray

        callback = self.llm_config.get_or_create_callback()  # as VLLMEngine.start does, before the engine
        await callback.run_callback("on_before_node_init")
        t0 = time.time()
        # As VLLMEngine does on GPUs (engines/vllm/vllm_engine.py, requires_remote_initialization):
        # the config is built in a Ray task with the replica's runtime_env, and this process never
        # calls vLLM's load_general_plugins() itself (only the LLMConfig's callback, run above, registers
        # vllm-tfm here).
        task = ray.remote(build_engine_config).options(num_cpus=0, runtime_env=ray.get_runtime_context().runtime_env)
        self.vllm_config = ray.get(task.remote(self.llm_config))
        config_s = time.time() - t0

        from vllm.ray.ray_env import get_env_vars_to_copy
        from vllm.v1.executor.ray_env_utils import get_driver_env_vars
        from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

        import vllm_tfm
        from vllm_tfm.vllm_plugin.options import get_drafter_dir, get_tfm_options
        from vllm_tfm.vllm_plugin.plugin import is_registered

        spec = self.vllm_config.speculative_config
        opts = get_tfm_options(self.vllm_config)
        self._load_decoder(opts, get_drafter_dir(self.vllm_config))
        copied = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS, destination="stand-in report")
        report = {
            "pid": os.getpid(),
            "vllm_tfm_file": vllm_tfm.__file__,
            "plugin_registered": is_registered(),
            "entry_points": sorted(f"{ep.name}={ep.value}" for ep in entry_points(group="vllm.general_plugins")),
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "tfm_options": opts.model_dump(mode="json", exclude={"weaver", "treeflash"}),
            "distributed_executor_backend": str(self.vllm_config.parallel_config.distributed_executor_backend),
            "enforce_eager": self.vllm_config.model_config.enforce_eager,
            "cudagraph_mode": str(self.vllm_config.compilation_config.cudagraph_mode),
            "cudagraph_capture_sizes": self.vllm_config.compilation_config.cudagraph_capture_sizes,
            "max_num_seqs": self.vllm_config.scheduler_config.max_num_seqs,
            "served_model_name": self.vllm_config.model_config.served_model_name,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_TFM_")},
            "vllm_ray_legacy_copies": sorted(k for k in copied if k.startswith("VLLM_TFM_")),
            "vllm_ray_v2_copies": sorted(k for k in get_driver_env_vars(WORKER_SPECIFIC_ENV_VARS) if k.startswith("VLLM_TFM_")),
            "config_seconds": round(config_s, 2),
        }
        path = os.environ.get(REPORT_ENV)
        if path:
            Path(path).write_text(json.dumps(report, indent=1))

    def _load_decoder(self, opts: Any, drafter_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from vllm_tfm.models import load_drafter_dir
        from vllm_tfm.reference import SpeculativeDecoder, make_proposer

        torch.set_num_threads(1)
        target = AutoModelForCausalLM.from_pretrained(self.vllm_config.model_config.model, dtype=torch.float32).eval()
        bundle = load_drafter_dir(drafter_dir, dtype=torch.float32, target_config=target.config)
        proposer = make_proposer(
            opts.proposal,
            bundle,
            target,
            top_k=opts.top_k,
            width=opts.width,
            children_per_node=opts.children_per_node,
            top_m=opts.treeflash_top_m,
        )
        self.decoder = SpeculativeDecoder(target, proposer, budget=opts.budget, acceptance=opts.sampling)

    async def completions(self, request: CompletionRequest, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        prompt = request.prompt
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            yield _error("the CPU stand-in engine takes prompts as one list of token ids")
            return
        max_tokens = request.max_tokens or 16
        try:
            params = request.to_sampling_params(max_tokens)
            vc = self.vllm_config
            params.verify(vc.model_config, vc.speculative_config, vc.structured_outputs_config, None)
        except ValueError as e:
            yield _error(str(e))
            return
        if params.temperature > 1e-5:
            yield _error("the CPU stand-in engine serves greedy requests (temperature 0) only")
            return
        result = self.decoder.generate(prompt, max_tokens)
        choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": result.tokens if request.return_token_ids else None}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(result.tokens), "total_tokens": len(prompt) + len(result.tokens)}
        yield CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=request.model or self.llm_config.model_id,
            choices=[choice],
            usage=usage,
        )

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        yield _error("the CPU stand-in engine serves /v1/completions only")

    async def embeddings(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        yield _error("the CPU stand-in engine serves /v1/completions only")

    async def transcriptions(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        yield _error("the CPU stand-in engine serves /v1/completions only")

    async def resolve_lora(self, lora_model: Any) -> None:
        raise ValueError("the CPU stand-in engine has no LoRA support")

    async def reset_prefix_cache(self) -> None:
        return None

    def routing_stats(self) -> dict:
        return {}

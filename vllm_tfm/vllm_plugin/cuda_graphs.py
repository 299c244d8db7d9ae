"""CUDA graphs for tfm engines: which of vLLM 0.26's cudagraph modes tfm runs, and with which sizes.

The choice is vLLM's own: ``enforce_eager`` and ``compilation_config.cudagraph_mode`` (pydantic
fields of vLLM's configs). tfm validates it and fills in what the user left unset:

* ``enforce_eager=True`` or ``cudagraph_mode`` NONE: no graphs (the tfm runtime as before).
* unset: FULL_AND_PIECEWISE on one GPU (:data:`DEFAULT_MODE`), PIECEWISE with tensor or data
  parallelism (:data:`PARALLEL_DEFAULT_MODE`).
* ``PIECEWISE`` (:data:`OPT_IN` asks for it explicitly): vLLM compiles the target and
  captures CUDA graphs of the pieces between its splitting ops. Everything tfm runs during the
  target forward runs inside two of those ops, eagerly, at every step: the tree-masked attention
  (``vllm::unified_attention_with_output`` calls the attention impl's ``forward``) and the GDN
  tree verify (``vllm::qwen_gdn_attention_core`` calls ``_forward_core``). The depth positions
  are written into the runner's persistent ``positions`` buffer, which the graphs read. Sampler,
  commit and drafter run after the forward. docs/vllm_plugin.md ("CUDA graphs") has the map.
  The DFlash drafter's forward gets vLLM's own piecewise graphs (vLLM captures drafter graphs
  whenever the target's mode has piecewise graphs); the Weaver build replays graphs of its own
  (``runtime/weaver_graphs.py``).
* ``FULL_AND_PIECEWISE`` (the default on one GPU): a full graph holds the whole forward, so no
  Python of tfm's runs at replay. tfm captures vLLM's full decode graphs (R requests x (B + 1)
  tokens) with the tree verify inside, its tables in persistent buffers
  (``runtime/full_graphs.py``): a tree step whose requests all verify B drafts replays the full
  graph of its size; every other step (mixed batches, fewer drafts, chains verified by vLLM's own
  path) replays the piecewise graphs (``runtime/graph_dispatch.py``). Needs the NVRTC kernel path;
  without it (no NVRTC, a bfloat16 SSM state, ...) the engine warns once at start-up and tree steps
  replay the piecewise graphs.
* ``FULL`` and ``FULL_DECODE_ONLY`` are refused: without piecewise graphs every tree step would
  run without graphs (FULL_DECODE_ONLY) or in a full graph that skips the tree code (FULL).

Capture sizes: a tree step of R requests has exactly R * (B + 1) tokens, which vLLM's default
list (1, 2, 4, 8, 16, ... up to 512) mostly misses (B = 64, batch 8: 520 tokens, past vLLM's
default maximum of 512, so such steps would run without graphs). When the user sets neither
``cudagraph_capture_sizes`` nor ``max_cudagraph_capture_size``, tfm sets the sizes to
``k * (B + 1)`` for k = 1 .. K (tree steps of up to K requests) plus 1, 2, 4, ... K (decode steps
of requests that have no drafts yet), with K = min(max_num_seqs, 64, max(16, 1024 // (B + 1))):
tree steps of up to 1,024 tokens (at least 16 requests, at most 64 sizes; 60 requests at B = 16,
31 at B = 32), as vLLM's own default covers speculative decode steps up to 512 tokens in about 67
sizes. With K = 16 a server at 32 concurrent requests and B = 16 ran nearly every tree step without
graphs (the soak of bench/NOTES.md section 24). vLLM drops sizes above ``max_num_batched_tokens``.
Larger steps (prefill chunks, bigger batches) run the compiled model without graphs.

Refused besides FULL / FULL_DECODE_ONLY, each with one line: ``splitting_ops`` that leave out
one of the two ops above, settings that make vLLM empty the splitting ops (``fuse_attn_quant``,
``enable_sp``, ``fuse_gemm_comms`` without Inductor graph partition), and
``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` (its capture does not break at the GDN op).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ACCEPTED_MODES",
    "ATTENTION_OP",
    "BREAKABLE_ENV",
    "DECODE_CAPTURE_REQUESTS",
    "TREE_CAPTURE_MAX_REQUESTS",
    "TREE_CAPTURE_TOKENS",
    "DEFAULT_MODE",
    "PARALLEL_DEFAULT_MODE",
    "GDN_OP",
    "REFUSED_MODES",
    "check_graph_config",
    "configure_engine_graphs",
    "required_splitting_ops",
    "tfm_capture_sizes",
]

logger = logging.getLogger("vllm_tfm")

ATTENTION_OP = "vllm::unified_attention_with_output"
"""Calls the attention impl's ``forward`` (model_executor/layers/attention/attention.py:818-845):
the tree mask of runtime/attention.py runs there."""
GDN_OP = "vllm::qwen_gdn_attention_core"
"""Calls ``QwenGatedDeltaNetAttention._forward_core`` (qwen_gdn_linear_attn.py:1619-1676): the
tree conv1d + GDN tree verify of runtime/gdn.py runs there."""

ACCEPTED_MODES: tuple[str, ...] = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE")
REFUSED_MODES: Mapping[str, str] = {
    "FULL": "a full graph replays the whole forward without tfm's tree attention and GDN tree verify",
    "FULL_DECODE_ONLY": "it has no piecewise graphs, so every tree step would run without graphs",
}
DEFAULT_MODE: str | None = "FULL_AND_PIECEWISE"
"""The mode a single-GPU tfm engine gets when ``cudagraph_mode`` is left unset (and enforce_eager is
off). FULL_AND_PIECEWISE since full tree graphs passed their GPU checks on the H200: greedy tokens ==
no speculation at batch 8 and 1 with 616 tree steps on full graphs (``bash bench/run_gpu_graphs.sh``,
``bench/results/graphs_zoo_full.json.gz``), the kernels on fixed-layout plans == per-step plans
(``tests/gpu/test_full_graph_kernels_gpu.py``); at Qwen3.6-27B shape 98.5 vs 62.4 tokens/s with
piecewise graphs at batch 1, 383 vs 355 at batch 8 (``e2e_27b_full_graphs.json.gz``, in git history at 1c9f37b).
None would mean eager (``enforce_eager=True``, with a warning naming the opt-in)."""
PARALLEL_DEFAULT_MODE = "PIECEWISE"
"""The unset mode with tensor or data parallelism > 1: full tree graphs have not run on more than one
GPU (data parallelism with FULL_AND_PIECEWISE is refused, see ``check_graph_config``)."""
OPT_IN = "compilation_config={'cudagraph_mode': 'PIECEWISE'}"
DECODE_CAPTURE_REQUESTS = 16
"""Tree steps of at least this many requests get a captured size of their own (see the module doc)."""
TREE_CAPTURE_TOKENS = 1024
"""...and of more requests while their tokens, R * (B + 1), stay within this (see the module doc)..."""
TREE_CAPTURE_MAX_REQUESTS = 64
"""...but never of more than this many requests (the number of captured tree-step sizes)."""
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"


def tfm_capture_sizes(budget: int, max_num_seqs: int | None, full: bool = False) -> list[int]:
    """Capture sizes of a tfm engine with tree budget B = ``budget``.

    k * (B + 1) for k = 1..K (a step verifying k trees) and the powers of two up to K plus K (k
    requests decoding one token, before their first drafts), K = min(max_num_seqs, 64, max(16,
    1024 // (B + 1))) (max_num_seqs None: no bound of its own). With
    ``full`` (full decode graphs: vLLM captures one for every size >= B + 1, which must then be a
    multiple of B + 1) the one-token sizes >= B + 1 that are not multiples of B + 1 are left out.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"the tree budget must be an integer >= 1, got {budget!r}")
    k = min(TREE_CAPTURE_MAX_REQUESTS, max(DECODE_CAPTURE_REQUESTS, TREE_CAPTURE_TOKENS // (budget + 1)))
    if max_num_seqs is not None:
        k = max(1, min(int(max_num_seqs), k))
    singles = {1 << i for i in range(k.bit_length())} | {k}
    if full:
        singles = {x for x in singles if x < budget + 1 or x % (budget + 1) == 0}
    trees = {r * (budget + 1) for r in range(1, k + 1)}
    return sorted(singles | trees)


def required_splitting_ops(is_hybrid: bool) -> tuple[str, ...]:
    """The vLLM custom ops that must stay out of the captured pieces for tfm's runtime."""
    return (ATTENTION_OP, GDN_OP) if is_hybrid else (ATTENTION_OP,)


def _mode_name(mode: Any) -> str | None:
    if mode is None:
        return None
    return str(getattr(mode, "name", mode)).upper()


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _set(config: Any, key: str, value: Any) -> None:
    if isinstance(config, dict):
        config[key] = value
    else:
        setattr(config, key, value)


def _check_mode(mode: str) -> None:
    if mode in REFUSED_MODES:
        raise ValueError(
            f"method 'tfm' does not support cudagraph_mode={mode} ({REFUSED_MODES[mode]}); "
            "use PIECEWISE or FULL_AND_PIECEWISE, or enforce_eager=True"
        )
    if mode not in ACCEPTED_MODES:
        raise ValueError(f"method 'tfm' does not support cudagraph_mode={mode}; use one of {', '.join(ACCEPTED_MODES)}")


def _check_breakable(mode: str) -> None:
    if mode != "NONE" and os.environ.get(BREAKABLE_ENV, "0") == "1":
        raise ValueError(
            f"method 'tfm' does not support {BREAKABLE_ENV}=1 with CUDA graphs (its capture does not break at "
            f"{GDN_OP}, where the GDN tree verify runs); unset it or use enforce_eager=True"
        )


def _check_splitting(compilation: Any, mode: str, is_hybrid: bool) -> None:
    if mode == "NONE":
        return
    ops = _get(compilation, "splitting_ops")
    if ops is not None:
        missing = [op for op in required_splitting_ops(is_hybrid) if op not in ops]
        if missing:
            raise ValueError(
                f"method 'tfm' with CUDA graphs needs {missing[0]} in compilation_config.splitting_ops "
                "(tfm's tree verification runs inside it, outside the graphs)"
            )
    passes = _get(compilation, "pass_config")
    partition = bool(_get(compilation, "use_inductor_graph_partition"))
    if passes is not None and not partition:
        for flag in ("fuse_attn_quant", "enable_sp", "fuse_gemm_comms"):
            if _get(passes, flag) is True:
                raise ValueError(
                    f"method 'tfm' with CUDA graphs does not support pass_config.{flag}=True without "
                    "use_inductor_graph_partition (vLLM then captures attention and GDN inside the graphs)"
                )


def configure_engine_graphs(engine_args: Any, target_model_config: Any, budget: int) -> str:
    """Config-time (EngineArgs, process 0): validate the user's graph settings for method 'tfm',
    fill in the tfm default mode and capture sizes; returns the cudagraph mode tfm asks vLLM for
    ("NONE" for eager). Raises ValueError (one line) on refused settings."""
    if bool(getattr(engine_args, "enforce_eager", False)) or bool(getattr(target_model_config, "enforce_eager", False)):
        return "NONE"
    compilation = getattr(engine_args, "compilation_config", None)
    if compilation is None:
        from vllm.config import CompilationConfig

        compilation = CompilationConfig()
        engine_args.compilation_config = compilation
    mode = _mode_name(_get(compilation, "cudagraph_mode"))
    if mode is None:
        level = getattr(engine_args, "optimization_level", None)
        if str(getattr(level, "name", level)) in ("0", "O0"):
            return "NONE"  # -O0: vLLM's default is no compilation, no graphs
        from vllm.config import CUDAGraphMode

        if DEFAULT_MODE is None:
            engine_args.enforce_eager = True
            target_model_config.enforce_eager = True
            logger.warning("vllm-tfm: method 'tfm' runs without CUDA graphs by default (enforce_eager=True); "
                           "%s opts in to piecewise CUDA graphs (experimental)", OPT_IN)
            return "NONE"
        parallel = any(int(getattr(engine_args, k, 1) or 1) > 1 for k in ("tensor_parallel_size", "data_parallel_size"))
        mode = PARALLEL_DEFAULT_MODE if parallel else DEFAULT_MODE
        _set(compilation, "cudagraph_mode", CUDAGraphMode[mode])
        logger.info("vllm-tfm: method 'tfm' runs with cudagraph_mode=%s; enforce_eager=True turns graphs off", mode)
    _check_mode(mode)
    is_hybrid = bool(getattr(target_model_config, "is_hybrid", False))
    _check_breakable(mode)
    _check_splitting(compilation, mode, is_hybrid)
    if mode == "NONE":
        return mode
    sizes_unset = all(
        v is None
        for v in (
            _get(compilation, "cudagraph_capture_sizes"),
            _get(compilation, "max_cudagraph_capture_size"),
            getattr(engine_args, "cudagraph_capture_sizes", None),
            getattr(engine_args, "max_cudagraph_capture_size", None),
        )
    )
    if sizes_unset:
        _set(compilation, "cudagraph_capture_sizes",
             tfm_capture_sizes(budget, getattr(engine_args, "max_num_seqs", None), full=mode == "FULL_AND_PIECEWISE"))
    return mode


def check_graph_config(vllm_config: Any) -> str:
    """Worker-time check of the final engine config (the GPU model runner of a tfm engine): the
    resolved cudagraph mode and splitting ops must leave tfm's tree code outside the graphs.
    Returns the mode name; raises ValueError (one line)."""
    comp = vllm_config.compilation_config
    mode = _mode_name(comp.cudagraph_mode) or "NONE"
    _check_mode(mode)
    if mode == "NONE":
        return mode
    _check_breakable(mode)
    ops = list(getattr(comp, "splitting_ops", None) or [])
    missing = [op for op in required_splitting_ops(bool(vllm_config.model_config.is_hybrid)) if op not in ops]
    if missing:
        raise ValueError(
            f"vllm-tfm with cudagraph_mode={mode} needs {missing[0]} among the splitting ops "
            f"(got {ops}); tfm's tree verification runs inside it"
        )
    if mode == "FULL_AND_PIECEWISE" and getattr(vllm_config.parallel_config, "data_parallel_size", 1) > 1:
        raise ValueError(
            "vllm-tfm does not support cudagraph_mode=FULL_AND_PIECEWISE with data parallelism > 1 (ranks agree on "
            "one graph mode per step, which may be a full graph during a tree step); use PIECEWISE"
        )
    return mode

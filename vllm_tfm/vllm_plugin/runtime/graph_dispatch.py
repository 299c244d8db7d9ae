"""Tree steps under vLLM 0.26's CUDA graphs: never a full graph, and what outlives a graph piece.

Which graph a step replays is decided by ``GPUModelRunner._determine_batch_execution_and_padding``
(v1/worker/gpu_model_runner.py:3877), called in ``execute_model`` right after ``_prepare_inputs``
(4197 -> 4217), so the step's tree metadata (``STATE.step``) is known by then. It asks vLLM's
``CudagraphDispatcher`` (v1/cudagraph_dispatcher.py:236) for a FULL key first, then a PIECEWISE
key, else no graph, and pads the token count to the captured size.

A full graph replays the whole forward, attention and GDN ops included, without running any
Python: tfm's tree mask (runtime/attention.py) and GDN tree verify (runtime/gdn.py) would be
skipped and the step verified as chains. So the wrapper below excludes FULL for every step that
verifies trees: it passes ``use_cascade_attn=True``, which in vLLM 0.26 only feeds the
dispatcher's ``invalid_modes={FULL}`` (gpu_model_runner.py:3932-3934; cascade attention itself is
decided elsewhere, from ``cascade_attn_prefix_lens``). With FULL_AND_PIECEWISE such a step then
replays the piecewise graph of its padded size; with PIECEWISE nothing changes. A tree step that
comes back FULL anyway (data-parallel mode sync, refused at startup) stops the engine. Dummy runs
(profiling, capture: they pass ``force_uniform_decode``) are left alone.

Graph memory: in PIECEWISE mode the inputs of a splitting op are outputs of the previous captured
piece, in CUDA-graph pool memory that later pieces reuse at replay. Anything the tree code keeps
past its op (the GDN stash for the commit) must be a copy, not a view: see
:func:`piece_outputs_are_reused`.

Every step of a tfm runner is counted in the tree metrics' hooks as ``cudagraph.<tree|other>.<mode>``
(``runtime.collect_tree_metrics``): how many tree steps replayed piecewise graphs, how many ran eager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .state import STATE

__all__ = ["GRAPH_HOOKS", "install_graph_dispatch", "piece_outputs_are_reused"]


def piece_outputs_are_reused() -> bool:
    """True inside a forward that replays (or captures) CUDA graphs: tensors handed to a splitting
    op live in the graph pool and are overwritten by later pieces, so keep copies, not views."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False
    return get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE


def _wrap_determine(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _determine_batch_execution_and_padding(
        self: Any,
        num_tokens: int,
        num_reqs: int,
        num_scheduled_tokens_np: Any,
        max_num_scheduled_tokens: int,
        use_cascade_attn: bool,
        **kwargs: Any,
    ) -> Any:
        if not getattr(self, "_tfm_enabled", False) or kwargs.get("force_uniform_decode") is not None:
            return orig(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                        use_cascade_attn, **kwargs)
        step = STATE.step
        tree = step is not None and step.tree_active
        out = orig(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                   use_cascade_attn or tree, **kwargs)
        mode = getattr(out[0], "name", str(out[0]))
        if tree and mode == "FULL":
            raise RuntimeError(
                "vllm-tfm: a step verifying trees was dispatched to a full CUDA graph, which would skip the tree "
                "verification; run with cudagraph_mode=PIECEWISE"
            )
        if STATE.metrics is not None:
            STATE.metrics.hook(f"cudagraph.{'tree' if tree else 'other'}.{mode}")
        return out

    return _determine_batch_execution_and_padding


GRAPH_HOOKS: dict[str, tuple[Callable[[Callable], Callable], str]] = {
    "_determine_batch_execution_and_padding": (
        _wrap_determine,
        "tfm: steps that verify trees never replay a full CUDA graph (piecewise or eager instead)",
    ),
}


def install_graph_dispatch() -> None:
    """Wrap the GPUModelRunner methods of :data:`GRAPH_HOOKS` through the plugin's patch registry."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ..patching import replace_attribute

    for name, (wrap, reason) in GRAPH_HOOKS.items():
        replace_attribute(GPUModelRunner, name, wrap, reason=reason)

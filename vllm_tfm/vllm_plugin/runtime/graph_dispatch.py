"""Tree steps under vLLM 0.26's CUDA graphs: which graph a step replays, and what outlives a graph piece.

Which graph a step replays is decided by ``GPUModelRunner._determine_batch_execution_and_padding``
(v1/worker/gpu_model_runner.py:3877), called in ``execute_model`` right after ``_prepare_inputs``
(4197 -> 4217), so the step's tree metadata (``STATE.step``) is known by then. It asks vLLM's
``CudagraphDispatcher`` (v1/cudagraph_dispatcher.py:236) for a FULL key first, then a PIECEWISE
key, else no graph, and pads the token count to the captured size.

A full graph replays the whole forward, attention and GDN ops included, without running any
Python. With ``cudagraph_mode=FULL_AND_PIECEWISE`` tfm captures its full decode graphs with the
tree verify inside (``full_graphs.py``; the ``_warmup_and_capture`` and ``_dummy_run`` wrappers
below set up each capture), and the wrapper of ``_determine_batch_execution_and_padding`` allows
FULL only for a tree step whose requests all verify B drafts and whose size has a captured tree
graph; it then writes the step's trees into the graph's buffers before the replay. Every other
step is kept off the full graphs (they verify trees, so a chain step through vLLM's own path must
not replay one; without tree graphs, a tree step must not replay vLLM's chain graphs): the wrapper
passes ``use_cascade_attn=True``, which in vLLM 0.26 only feeds the dispatcher's
``invalid_modes={FULL}`` (gpu_model_runner.py:3932-3934; cascade attention itself is decided
elsewhere, from ``cascade_attn_prefix_lens``), so the step replays the piecewise graph of its
padded size. A step that comes back FULL anyway (data-parallel mode sync, refused at startup)
stops the engine. With one GDN state slot per request (``one_slot.py``) vLLM's own full decode graphs
would run its chain kernel: they are not captured, and without tfm's tree graphs every step with drafts
replays a piecewise graph. Dummy runs (profiling, capture: they pass ``force_uniform_decode``) are left
alone. In PIECEWISE mode (the default with tensor or data parallelism) nothing is full.

Graph memory: in PIECEWISE mode the inputs of a splitting op are outputs of the previous captured
piece, in CUDA-graph pool memory that later pieces reuse at replay. Anything the tree code keeps
past its op (the GDN stash for the commit) must be a copy, not a view: see
:func:`piece_outputs_are_reused`.

Every step of a tfm runner is counted in the tree metrics' hooks as ``cudagraph.<tree|other>.<mode>``
(``runtime.collect_tree_metrics``): how many tree steps replayed full or piecewise graphs, how many ran eager.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .full_graphs import FullTreeGraphsUnavailable, TreeGraphs, replayable
from .state import STATE
from .step_kernels import current_step_kernels

logger = logging.getLogger("vllm.tfm")  # under vLLM's logger, so the notice shows in its output

__all__ = ["GRAPH_HOOKS", "enable_tree_graphs", "install_graph_dispatch", "piece_outputs_are_reused", "tree_graphs_of"]


def piece_outputs_are_reused() -> bool:
    """True inside a forward that replays (or captures) CUDA graphs: tensors handed to a splitting
    op live in the graph pool and are overwritten by later pieces, so keep copies, not views."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False
    return get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE


def tree_graphs_of(runner: Any) -> TreeGraphs | None:
    """The runner's full tree graphs (``full_graphs.py``), None when its mode has no full decode graphs."""
    return getattr(runner, "_tfm_tree_graphs", None)


def enable_tree_graphs(runner: Any, budget: int, depth_bound: int | None = None) -> TreeGraphs | None:
    """At runner start: full tree graphs when the engine's cudagraph mode captures full decode graphs
    (FULL_AND_PIECEWISE), sized for min(max_num_seqs, largest capture size // (B + 1)) requests;
    ``depth_bound``: the drafter's tree depth (``TreeGraphs``)."""
    from vllm.config import CUDAGraphMode

    comp = runner.compilation_config
    mode = comp.cudagraph_mode
    if mode is None or mode.decode_mode() != CUDAGraphMode.FULL or not mode.separate_routine():
        runner._tfm_tree_graphs = None
        return None
    nodes = budget + 1
    largest = comp.max_cudagraph_capture_size or 0
    max_reqs = min(int(runner.scheduler_config.max_num_seqs), int(largest) // nodes)
    graphs = None
    if max_reqs >= 1:
        graphs = TreeGraphs(budget, max_reqs, int(runner.max_model_len), runner.device, depth_bound=depth_bound)
    runner._tfm_tree_graphs = graphs
    return graphs


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
        graphs = tree_graphs_of(self)
        full_trees = graphs is not None and bool(graphs.captured)
        # FULL only for a tree step that fits a captured tree graph; once tree graphs exist, never for
        # other steps (the full graphs verify trees); with one GDN state slot per request never vLLM's own
        # full graphs (their chain kernel reads 1 + B slots: one_slot.py)
        allow_full = full_trees and tree and replayable(step, graphs.nodes, graphs.captured)
        forbid_full = (tree or full_trees or STATE.one_slot) and not allow_full

        def dispatch(no_full: bool) -> Any:
            return orig(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
                        use_cascade_attn or no_full, **kwargs)

        out = dispatch(forbid_full)
        mode = getattr(out[0], "name", str(out[0]))
        if mode == "FULL" and allow_full and out[1].num_tokens != step.num_tokens:
            forbid_full = True  # padded to another size: that graph's tables would not be this step's
            out = dispatch(True)
            mode = getattr(out[0], "name", str(out[0]))
        if mode == "FULL":
            if forbid_full:
                raise RuntimeError(
                    "vllm-tfm: a step was dispatched to a full CUDA graph that does not verify its trees; "
                    "run with cudagraph_mode=PIECEWISE"
                )
            if allow_full:  # the trees into the graph's buffers once their topology is known (deferred drafts)
                step.replay_graphs = graphs
                step.after_topology(graphs.prepare_replay)
        if STATE.metrics is not None:
            STATE.metrics.hook(f"cudagraph.{'tree' if tree else 'other'}.{mode}")
        return out

    return _determine_batch_execution_and_padding


def _wrap_warmup_and_capture(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _warmup_and_capture(self: Any, desc: Any, cudagraph_runtime_mode: Any, *args: Any, **kwargs: Any) -> Any:
        graphs = tree_graphs_of(self)
        full_uniform = getattr(cudagraph_runtime_mode, "name", None) == "FULL" and desc.uniform
        if graphs is not None and full_uniform:
            try:
                with graphs.capture(graphs.requests_of(desc.num_tokens)):
                    return orig(self, desc, cudagraph_runtime_mode, *args, **kwargs)
            except FullTreeGraphsUnavailable as exc:
                if graphs.captured:  # the full graphs already captured verify trees: no way back to vLLM's
                    raise RuntimeError(f"vllm-tfm: {exc}; use cudagraph_mode=PIECEWISE") from exc
                self._tfm_tree_graphs = None
                logger.warning("vllm-tfm: full CUDA graphs of tree steps are off: %s. %s", exc.reason,
                               "Steps with drafts replay the piecewise graphs (one GDN state slot per request: vLLM's "
                               "own full decode graphs are not captured)." if STATE.one_slot else
                               "Tree steps replay the piecewise graphs; the full decode graphs are vLLM's own.")
        if full_uniform and STATE.one_slot and getattr(self, "_tfm_enabled", False):
            return None  # vLLM's own full decode graph would capture its chain kernel (one_slot.py); never replayed
        return orig(self, desc, cudagraph_runtime_mode, *args, **kwargs)

    return _warmup_and_capture


def _wrap_dummy_run(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _dummy_run(self: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        graphs = tree_graphs_of(self)
        if graphs is None or not graphs.capturing:
            return orig(self, num_tokens, *args, **kwargs)
        graphs.begin_run()
        capturing = bool(kwargs.get("is_graph_capturing"))
        undo = None if capturing else _pose_as_spec_batch(self, graphs.capture_reqs, graphs.budget)
        try:
            out = orig(self, num_tokens, *args, **kwargs)
        finally:
            if undo is not None:
                undo()
        if capturing:
            graphs.end_capture_run(current_step_kernels(STATE.step))
        return out

    return _dummy_run


def _pose_as_spec_batch(runner: Any, num_reqs: int, budget: int) -> Callable[[], None]:
    """Make a warm-up run of a full tree graph capture a batch of R spec decodes of B drafts for the
    GDN metadata builder, as the capture itself is (``build_for_cudagraph_capture`` derives it from the
    query lengths); the warm-up then runs the tree kernels eagerly (compiling them and allocating
    the stash before the capture). The runner's ``num_decode_draft_tokens`` (rewritten by every real
    step's ``_prepare_inputs``) and ``num_accepted_tokens`` rows are restored afterwards."""
    drafts = runner.num_decode_draft_tokens.cpu
    accepted = runner.num_accepted_tokens.gpu
    saved = drafts.clone(), accepted[:num_reqs].clone()
    drafts.fill_(-1)
    drafts[:num_reqs] = budget
    accepted[:num_reqs] = 1

    def undo() -> None:
        drafts.copy_(saved[0])
        accepted[:num_reqs].copy_(saved[1])

    return undo


GRAPH_HOOKS: dict[str, tuple[Callable[[Callable], Callable], str]] = {
    "_determine_batch_execution_and_padding": (
        _wrap_determine,
        "tfm: tree steps replay full CUDA graphs only when a captured tree graph fits them (else piecewise or eager)",
    ),
    "_warmup_and_capture": (
        _wrap_warmup_and_capture,
        "tfm: full decode graphs are captured with the tree verify inside (FULL_AND_PIECEWISE)",
    ),
    "_dummy_run": (_wrap_dummy_run, "tfm: fresh tree tables for each run of a full tree graph capture"),
}


def install_graph_dispatch() -> None:
    """Wrap the GPUModelRunner methods of :data:`GRAPH_HOOKS` through the plugin's patch registry."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ..patching import replace_attribute

    for name, (wrap, reason) in GRAPH_HOOKS.items():
        replace_attribute(GPUModelRunner, name, wrap, reason=reason)

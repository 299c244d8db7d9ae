"""Where a decode step's host time goes, without a profiler's overhead (benchmark-only).

``bench/e2e.py --host-spans`` runs each batch once more with wall-clock timers around a fixed list
of methods of the live engine objects (vLLM's engine core, scheduler and model runner, our
proposer and Weaver graphs): instance attributes that shadow the bound methods, so the plugin's
own hooks (installed on the classes) run inside the timed spans, and nothing outside the run is
touched (:func:`uninstall` restores the instances). Spans nest: each records its inclusive time
and its exclusive time (inclusive minus the spans it called), so per-step exclusive times add up
to the host time inside the top-level spans; ``untimed_ms_per_step`` is the run's wall time outside
every span (``LLM.generate``'s own loop and output handling).

Why this and not cProfile (``--host-profile``): cProfile charges every Python call, which doubles
the host time of a step of many small calls; these timers cost two ``perf_counter`` calls per
span, a few dozen spans per step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTR_TARGETS",
    "TARGETS",
    "GcClock",
    "SpanClock",
    "engine_objects",
    "install",
    "install_attrs",
    "uninstall",
    "uninstall_attrs",
]

# (object key in engine_objects(), method names). Missing methods are skipped and reported.
TARGETS: dict[str, tuple[str, ...]] = {
    "engine_core": ("step", "post_step"),
    "scheduler": ("schedule", "update_from_output", "update_draft_token_ids"),
    "output_processor": ("process_outputs",),
    "runner": (
        "execute_model", "_update_states", "_prepare_inputs", "_prepare_input_ids", "_calc_spec_decode_metadata",
        "_determine_batch_execution_and_padding", "_get_slot_mappings", "_build_attention_metadata",
        "_preprocess", "_model_forward", "sample_tokens", "_sample",
        "_update_states_after_model_execute", "propose_draft_token_ids", "_bookkeeping_sync", "take_draft_token_ids",
        "_copy_draft_token_ids_to_cpu", "_get_cumsum_and_arange",
    ),
    "drafter": ("propose", "_build", "_verifier_hidden"),
    "weaver_graphs": ("weaver_trees",),
}


# (module, class or None for a module global, attribute): patched where the callers look them up, for
# the run only. Module globals are patched in the module that imported them by name.
ATTR_TARGETS: tuple[tuple[str, str | None, str], ...] = (
    ("vllm_tfm.vllm_plugin.runtime.hooks", None, "fix_accepted_offsets"),
    ("vllm_tfm.vllm_plugin.runtime.hooks", None, "build_step_tree"),
    ("vllm_tfm.vllm_plugin.runtime.hooks", None, "tree_positions"),
    ("vllm_tfm.vllm_plugin.runtime.hooks", None, "needs_native_sampler"),
    ("vllm_tfm.vllm_plugin.runtime.metrics", "Metrics", "record_step"),
    ("vllm_tfm.vllm_plugin.runtime.state", "ProposalStore", "_ingest"),  # the wait for the trees' host copy
    ("vllm_tfm.vllm_plugin.runtime.state", "StepTree", "complete"),  # deferred topology (deferred_drafts.py)
    ("vllm_tfm.vllm_plugin.runtime.state", "ProposalStore", "finalize"),  # the Weaver's deferred tail, then the copy
    ("vllm_tfm.vllm_plugin.runtime.state", "ProposalStore", "match"),
    ("vllm_tfm.vllm_plugin.runtime.weaver_graphs", "DeferredTail", "finish"),  # waits for the drafter's end
    ("vllm_tfm.vllm_plugin.runtime.state", "StepTree", "upload"),
    ("vllm_tfm.vllm_plugin.runtime.state", None, "packed_upload"),
    ("vllm_tfm.vllm_plugin.runtime.inputs", None, "_topology_arrays"),
    ("vllm_tfm.vllm_plugin.runtime.inputs", None, "ancestor_bits_and_depths"),
    ("vllm_tfm.vllm_plugin.runtime.full_graphs", "TreeGraphs", "prepare_replay"),
    ("vllm_tfm.vllm_plugin.runtime.full_graphs", None, "StepKernels"),
    ("vllm_tfm.vllm_plugin.runtime.full_graphs", None, "set_step_kernels"),
    ("vllm_tfm.vllm_plugin.runtime.graph_dispatch", None, "replayable"),
    ("vllm_tfm.kernels.plan", "TreePlan", "build_into"),
    ("vllm_tfm.kernels.plan", None, "_host_plan"),
    ("vllm_tfm.kernels.plan", None, "upload_into"),
    ("vllm_tfm.kernels.tree_attention", "TreeAttentionPlan", "build_into"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder", "build"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder", "update_block_table"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadataBuilder", "build"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadataBuilder", "update_block_table"),
    ("vllm.v1.worker.block_table", "MultiGroupBlockTable", "compute_slot_mapping"),
    ("vllm.v1.worker.block_table", "MultiGroupBlockTable", "commit_block_table"),
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper", "__call__"),
    ("torch.cuda.graphs", "CUDAGraph", "replay"),
)


@dataclass
class _Stat:
    count: int = 0
    inclusive_s: float = 0.0
    exclusive_s: float = 0.0


@dataclass
class SpanClock:
    """Nested wall-clock spans: ``with clock.span(name)`` or :meth:`wrap`."""

    clock: Callable[[], float] = time.perf_counter
    stats: dict[str, _Stat] = field(default_factory=dict)
    _stack: list[list[float]] = field(default_factory=list)  # [start, child seconds] per open span
    top_level_s: float = 0.0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [self.clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                took = self.clock() - frame[0]
                self._stack.pop()
                st = self.stats.setdefault(name, _Stat())
                st.count += 1
                st.inclusive_s += took
                st.exclusive_s += took - frame[1]
                if self._stack:
                    self._stack[-1][1] += took
                else:
                    self.top_level_s += took

        return timed

    def reset(self) -> None:
        self.stats.clear()
        self._stack.clear()
        self.top_level_s = 0.0

    def report(self, steps: int, wall_s: float) -> dict[str, Any]:
        """Per-step milliseconds by span (``steps``: the run's decode steps, e.g. execute_model calls)."""
        per = max(steps, 1)
        rows = {
            name: {"calls_per_step": round(st.count / per, 3), "inclusive_ms_per_step": round(1e3 * st.inclusive_s / per, 4),
                   "exclusive_ms_per_step": round(1e3 * st.exclusive_s / per, 4)}
            for name, st in sorted(self.stats.items(), key=lambda kv: -kv[1].exclusive_s)
        }
        return {"steps": steps, "wall_ms_per_step": round(1e3 * wall_s / per, 4),
                "untimed_ms_per_step": round(1e3 * (wall_s - self.top_level_s) / per, 4), "spans": rows}


@dataclass
class GcClock:
    """Time inside Python's cyclic garbage collector (``gc.callbacks``), by generation: a collection
    is charged to whatever span runs when it starts, so the spans' numbers include it."""

    clock: Callable[[], float] = time.perf_counter
    seconds: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    _start: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = self.clock()
        elif phase == "stop" and self._start is not None:
            gen = int(info.get("generation", -1))
            self.seconds[gen] = self.seconds.get(gen, 0.0) + self.clock() - self._start
            self.counts[gen] = self.counts.get(gen, 0) + 1
            self._start = None

    def install(self) -> None:
        import gc

        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        import gc

        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def report(self, steps: int) -> dict[str, Any]:
        per = max(steps, 1)
        return {"ms_per_step": round(1e3 * sum(self.seconds.values()) / per, 4),
                "by_generation": {str(g): {"collections": self.counts[g], "ms_total": round(1e3 * self.seconds[g], 3)}
                                  for g in sorted(self.seconds)}}


def engine_objects(llm: Any) -> dict[str, Any]:
    """The live objects of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) by TARGETS key;
    absent ones are left out."""
    found: dict[str, Any] = {}
    engine = getattr(llm, "llm_engine", None)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    if core is not None:
        found["engine_core"] = core
        if getattr(core, "scheduler", None) is not None:
            found["scheduler"] = core.scheduler
        executor = getattr(core, "model_executor", None)
        worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
        runner = getattr(worker, "model_runner", None)
        if runner is not None:
            found["runner"] = runner
            drafter = getattr(runner, "drafter", None)
            if drafter is not None:
                found["drafter"] = drafter
                graphs = getattr(drafter, "_weaver_graphs", None)
                if graphs is not None:
                    found["weaver_graphs"] = graphs
    if getattr(engine, "output_processor", None) is not None:
        found["output_processor"] = engine.output_processor
    return found


def install(clock: SpanClock, objects: dict[str, Any], targets: dict[str, Iterable[str]] = TARGETS) -> list[tuple[Any, str]]:
    """Shadow each listed method by a timed instance attribute; returns what was installed (for
    :func:`uninstall`). Raises if a method is already shadowed (installed twice)."""
    done: list[tuple[Any, str]] = []
    for key, names in targets.items():
        obj = objects.get(key)
        if obj is None:
            continue
        for name in names:
            if name in vars(obj):
                raise RuntimeError(f"host spans: {key}.{name} is already an instance attribute")
            fn = getattr(obj, name, None)
            if fn is None or not callable(fn):
                continue
            setattr(obj, name, clock.wrap(f"{key}.{name}", fn))
            done.append((obj, name))
    return done


def uninstall(installed: list[tuple[Any, str]]) -> None:
    for obj, name in installed:
        vars(obj).pop(name, None)


def install_attrs(clock: SpanClock, targets: Iterable[tuple[str, str | None, str]] = ATTR_TARGETS,
                  ) -> tuple[list[tuple[Any, str, Any]], list[str]]:
    """Patch each (module, class, attribute) with a timed wrapper (static methods stay static); returns
    (what to restore, the targets not found)."""
    import importlib
    import inspect

    saved: list[tuple[Any, str, Any]] = []
    missing: list[str] = []
    for module, cls, name in targets:
        label = f"{cls or module.rsplit('.', 1)[-1]}.{name}"
        try:
            owner: Any = importlib.import_module(module)
            if cls is not None:
                owner = getattr(owner, cls)
        except (ImportError, AttributeError):
            missing.append(label)
            continue
        raw = inspect.getattr_static(owner, name, None)  # inherited methods too (the patch shadows them)
        if raw is None:
            missing.append(label)
            continue
        if isinstance(raw, staticmethod):
            new: Any = staticmethod(clock.wrap(label, raw.__func__))
        elif isinstance(raw, classmethod):
            new = classmethod(clock.wrap(label, raw.__func__))
        elif callable(raw):
            new = clock.wrap(label, raw)
        else:
            missing.append(label)
            continue
        own = name in vars(owner)
        setattr(owner, name, new)
        saved.append((owner, name, raw if own else _INHERITED))
    return saved, missing


_INHERITED = object()  # restore marker: the attribute came from a base class, delete the shadow


def uninstall_attrs(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, name, raw in reversed(saved):
        if raw is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, raw)

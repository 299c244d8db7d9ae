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

The step's timeline (:func:`step_timeline`): at the entry and exit of the spans in :data:`MARKED` a
CUDA event is recorded too, so each point of a typical step says when the host got there and when
the GPU did; where the two meet, the GPU was waiting for the host. A mark is taken outside its own
span, so its cost (an event's creation and record, ~22 marks per step) falls in the enclosing spans'
exclusive times and in the step's wall time. ``CUDAGraphWrapper.__call__`` is split by what the call
did (replayed its graph or ran the wrapped code) and for which caller.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ATTR_TARGETS",
    "MARKED",
    "SUFFIXES",
    "TARGETS",
    "GcClock",
    "SpanClock",
    "engine_objects",
    "graph_call_suffix",
    "install",
    "install_attrs",
    "step_timeline",
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
    ("vllm.compilation.cuda_graph", "CUDAGraphWrapper", "__call__"),  # labelled by mode and caller: SUFFIXES
    ("vllm.compilation.cuda_graph", None, "get_forward_context"),
    ("vllm.compilation.cuda_graph", None, "is_forward_context_available"),
    ("vllm.compilation.cuda_graph", None, "get_offloader"),
    ("torch.cuda.graphs", "CUDAGraph", "replay"),
)

# Spans whose entry and exit get a GPU mark when the clock has a marker (e2e.py --host-spans): the points
# of a step where it matters whether the GPU is still busy or waits for the host.
MARKED: frozenset[str] = frozenset({
    "runner.execute_model", "runner._prepare_inputs", "runner._build_attention_metadata", "runner._preprocess",
    "runner._model_forward", "runner._sample", "runner._bookkeeping_sync", "runner._update_states_after_model_execute",
    "runner.propose_draft_token_ids", "drafter.propose", "scheduler.schedule",
})


def graph_call_suffix(clock: SpanClock, args: tuple[Any, ...]) -> str:
    """``[<the wrapper's mode> replay|run:<the step's mode> < <caller span>]`` for CUDAGraphWrapper.__call__:
    whether this call replays its graph or runs the wrapped code, and for whom."""
    wrapper = args[0] if args else None
    mode = getattr(getattr(wrapper, "runtime_mode", None), "name", "?")
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        now = getattr(get_forward_context().cudagraph_runtime_mode, "name", "?") if is_forward_context_available() \
            else "no-context"
    except Exception:  # noqa: BLE001 - a label, never a failure of the timed call
        now = "?"
    how = "replay" if now == mode else f"run:{now}"
    return f"[{mode} {how} < {clock.parent() or '-'}]"


SUFFIXES: dict[str, Callable[[SpanClock, tuple[Any, ...]], str]] = {"CUDAGraphWrapper.__call__": graph_call_suffix}


@dataclass
class _Stat:
    count: int = 0
    inclusive_s: float = 0.0
    exclusive_s: float = 0.0


@dataclass
class SpanClock:
    """Nested wall-clock spans: ``with clock.span(name)`` or :meth:`wrap`.

    GPU marks (optional): for the spans named in ``marked``, ``marker()`` is called at the span's entry
    and exit (on the GPU host: a CUDA event recorded on the current stream) and kept with the host
    time; :func:`step_timeline` turns them into where the host and the GPU stood at each point of a
    typical step."""

    clock: Callable[[], float] = time.perf_counter
    stats: dict[str, _Stat] = field(default_factory=dict)
    _stack: list[list[Any]] = field(default_factory=list)  # [start, child seconds, label] per open span
    top_level_s: float = 0.0
    marker: Callable[[], Any] | None = None
    marked: frozenset[str] = frozenset()
    marks: list[tuple[str, str, float, Any]] = field(default_factory=list)  # (span, "start"/"end", host s, stamp)
    max_marks: int = 100_000

    def parent(self) -> str | None:
        """The innermost open span's label."""
        return self._stack[-1][2] if self._stack else None

    def _mark(self, name: str, phase: str) -> None:
        if self.marker is not None and name in self.marked and len(self.marks) < self.max_marks:
            stamp = self.marker()
            self.marks.append((name, phase, self.clock(), stamp))

    def wrap(self, name: str, fn: Callable[..., Any],
             suffix: Callable[[SpanClock, tuple[Any, ...]], str] | None = None) -> Callable[..., Any]:
        """``fn`` timed as ``name`` (plus ``suffix(clock, args)`` when given: e.g. which caller, which mode)."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = name if suffix is None else name + suffix(self, args)
            self._mark(name, "start")
            frame: list[Any] = [self.clock(), 0.0, label]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                took = self.clock() - frame[0]
                self._stack.pop()
                st = self.stats.setdefault(label, _Stat())
                st.count += 1
                st.inclusive_s += took
                st.exclusive_s += took - frame[1]
                if self._stack:
                    self._stack[-1][1] += took
                else:
                    self.top_level_s += took
                self._mark(name, "end")

        return timed

    def reset(self) -> None:
        self.stats.clear()
        self._stack.clear()
        self.marks.clear()
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
        suffix = SUFFIXES.get(label)
        if isinstance(raw, staticmethod):
            new: Any = staticmethod(clock.wrap(label, raw.__func__, suffix))
        elif isinstance(raw, classmethod):
            new = classmethod(clock.wrap(label, raw.__func__, suffix))
        elif callable(raw):
            new = clock.wrap(label, raw, suffix)
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


def step_timeline(marks: list[tuple[str, str, float, Any]], base_host_s: float, base_stamp: Any,
                  elapsed_ms: Callable[[Any, Any], float], step_span: str = "runner.execute_model",
                  skip_steps: int = 2) -> dict[str, Any]:
    """Where the host and the GPU stood at each marked point of a typical step.

    ``base_stamp`` was recorded on an idle GPU at host time ``base_host_s`` (after a synchronize), so a
    stamp's ``elapsed_ms(base_stamp, stamp)`` puts the moment the GPU reached it on the host's clock. A
    step starts at each entry of ``step_span``; a point is (span, start/end, its n-th occurrence in the
    step). Per point, medians over the steps after ``skip_steps``: ``host_ms`` (the host's time since the
    step's start), ``gpu_ms`` (when the GPU got there, same origin) and ``gpu_behind_ms`` (their difference:
    the GPU work queued ahead of that point; near 0 means the GPU was waiting for the host there), and
    ``step_ms``, the median time from one step's start to the next's. Points present in fewer than half
    the steps are left out."""
    import statistics

    steps: list[dict[str, tuple[float, float]]] = []
    starts: list[float] = []
    seen: dict[str, int] = {}
    start_ms = 0.0
    for name, phase, host_s, stamp in marks:
        host_ms = 1e3 * (host_s - base_host_s)
        if name == step_span and phase == "start":
            steps.append({})
            starts.append(host_ms)
            seen = {}
            start_ms = host_ms
        if not steps:
            continue
        key = f"{name}:{phase}"
        k = seen.get(key, 0)
        seen[key] = k + 1
        point = key if k == 0 else f"{key}#{k + 1}"
        steps[-1][point] = (host_ms - start_ms, elapsed_ms(base_stamp, stamp) - start_ms)
    used = steps[skip_steps:]
    rows = []
    points = {p for st in used for p in st}
    for p in points:
        vals = [st[p] for st in used if p in st]
        if 2 * len(vals) < len(used):
            continue
        rows.append({"point": p, "host_ms": round(statistics.median(v[0] for v in vals), 4),
                     "gpu_ms": round(statistics.median(v[1] for v in vals), 4),
                     "gpu_behind_ms": round(statistics.median(v[1] - v[0] for v in vals), 4), "steps": len(vals)})
    rows.sort(key=lambda r: r["host_ms"])
    lengths = [b - a for a, b in zip(starts[skip_steps:], starts[skip_steps + 1:])]
    step_ms = round(statistics.median(lengths), 4) if lengths else None
    return {"steps": len(used), "skipped_steps": min(skip_steps, len(steps)), "step_ms": step_ms, "points": rows}

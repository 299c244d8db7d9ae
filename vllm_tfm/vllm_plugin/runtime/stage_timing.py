"""Per-stage timings of decode steps from CUDA events (``VLLM_TFM_PROFILE=1``), off by default.

When the switch is set in a process before the plugin installs its runtime hooks there, every
model runner of that process (tfm or not: the no-speculation and in-tree DFlash arms of a
benchmark are timed the same way) records a pair of CUDA events around each stage:

=====================  ====================================================================
``execute_model``      ``GPUModelRunner.execute_model``: input preparation, target forward, logits
``target_forward``     ``GPUModelRunner._model_forward``: the target model (for tfm: the tree verify)
``gdn_layer``          tfm tree steps, per GDN layer: the whole patched ``_forward_core`` (the body of
                       vLLM's splitting op ``qwen_gdn_attention_core``: our tree rows and vLLM's rows)
``gdn_tree``           tfm tree steps, per GDN layer: our tree path for the spec rows (row selection,
                       tree conv, gates, tree verify, stash for the commit, output scatter)
``gdn_tree_conv``      tfm tree steps, per GDN layer: the tree causal conv1d inside ``gdn_tree``
``gdn_tree_verify``    tfm tree steps, per GDN layer: the rollback-free tree verify inside ``gdn_tree``
``attention_layer``    tfm tree steps, per target attention layer: ``TFMTritonAttentionImpl.forward``
                       (vLLM's batched Triton attention, then the tree rows; not the KV-cache write)
``attention_tree``     tfm tree steps, per target attention layer: the tree rows (one kernel launch
                       or one Triton call per tree request) inside ``attention_layer``
``prepare_tree``       tfm: tree metadata and depth positions (in ``_prepare_inputs``)
``sample_tokens``      ``GPUModelRunner.sample_tokens``: sampling, commit, drafting, bookkeeping
``sample``             ``GPUModelRunner._sample``: the (tree) rejection sampler
``replay_accept``      tfm in acceptance-replay mode: the replayed draw (bench-only, in ``sample``)
``commit``             tfm: KV compaction + GDN state / conv commit
``propose``            ``propose_draft_token_ids``: all drafting (DFlash arm and tfm)
``draft``              tfm: the DFlash forward (context K/V, marginals) inside ``propose``
``replay_shaping``     tfm in acceptance-replay mode: spine-first marginals (bench-only, in ``propose``)
``tree_build``         tfm: chain / DDTree / Weaver tree construction inside ``propose``
=====================  ====================================================================

Stages nest (``execute_model`` holds ``target_forward`` and ``prepare_tree``; ``target_forward``
holds ``gdn_layer`` and ``attention_layer``; ``gdn_layer`` holds ``gdn_tree``, which holds
``gdn_tree_conv`` and ``gdn_tree_verify``; ``attention_layer`` holds ``attention_tree``;
``sample_tokens`` holds ``sample``, ``commit`` and ``propose``; ``propose`` holds ``draft``,
``replay_shaping`` and ``tree_build``). An event pair measures the time between the device
reaching the two events, so a host-bound stage (eager launches, or the eager splitting ops
between piecewise CUDA-graph pieces) counts its launch time, which is what it costs a step; the
host time of each span (``host_*``) is kept next to it: host close to device means launch-bound.

Per step: :meth:`StageTimer.note_batch` (called once per ``execute_model``) starts a step, and
every span belongs to the step started last. The per-layer stages (:data:`LAYER_STAGES`) run once
per layer call, 48 GDN or 16 attention spans per step at the 27B shape; their per-step numbers
are SUMS over the layers of a step: ``per_step_ms`` is a stage's total over the run divided by
the run's steps (all of them, so stages nest and subtract per step: rest of the forward =
``target_forward - gdn_tree - attention_tree``), ``per_step_sum`` the distribution of the per-step
sums over the steps in which the stage ran, ``spans_per_step`` its spans per such step; ``count``,
``median_ms`` etc. are per span (one layer call).

Events are resolved lazily: at :meth:`StageTimer.collect`, and every :data:`DRAIN_EVERY` spans
those already reached by the device are resolved without waiting (a tfm tree step at the 27B
shape records about 240 spans, so this runs every ~17 steps and keeps a few thousand event pairs
alive); only more than :data:`MAX_PENDING` unresolved spans make the host wait. So timing adds no
synchronisation inside a step. Without CUDA the spans fall back to wall time; inside a CUDA-graph
capture they record nothing (and a replayed graph runs no Python: in FULL graph mode the layer
spans do not exist). The host time the timer itself spends creating and recording events is
summed too (``timer_host_ms_per_step``, a lower bound on what timing adds to a step).

Off means next to no work: the extra runner hooks (``execute_model``, ``_model_forward``,
``_sample``) are not installed at all, and the tfm-internal spans (per-layer ones included) return
one shared null context (no events, no lists; entering it costs well under a microsecond). Read the numbers in the engine's worker with :func:`collect_stage_timings`, e.g.
from the driver through ``LLM.collective_rpc(collect_stage_timings, kwargs={"reset": True})``
(vLLM calls it with the worker as first argument; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the
worker is in-process), or write them to a JSON file with :func:`dump_stage_timings`.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Self

import torch

__all__ = [
    "ANNOTATION_PREFIX",
    "PROFILE_ENV",
    "STAGES",
    "LAYER_STAGES",
    "DRAIN_EVERY",
    "MAX_PENDING",
    "StageTimer",
    "TIMER",
    "profiling_enabled",
    "collect_stage_timings",
    "set_stage_timing",
    "dump_stage_timings",
    "summarize",
]

PROFILE_ENV = "VLLM_TFM_PROFILE"
ANNOTATION_PREFIX = "tfm:"
"""Prefix of the profiler ranges that annotated spans open (``set_stage_timing(annotate=True)``)."""
STAGES = (
    "execute_model",
    "target_forward",
    "gdn_layer",
    "gdn_tree",
    "gdn_tree_conv",
    "gdn_tree_verify",
    "attention_layer",
    "attention_tree",
    "prepare_tree",
    "sample_tokens",
    "sample",
    "replay_accept",
    "commit",
    "propose",
    "draft",
    "replay_shaping",
    "tree_build",
)
LAYER_STAGES = ("gdn_layer", "gdn_tree", "gdn_tree_conv", "gdn_tree_verify", "attention_layer", "attention_tree")
"""Stages recorded once per layer call: their per-step numbers are sums over the step's layers."""
DRAIN_EVERY = 4096
MAX_PENDING = 4 * DRAIN_EVERY
_NULL = nullcontext()


def profiling_enabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(PROFILE_ENV, "0").strip() not in ("", "0", "false", "False")


def summarize(ms: list[float]) -> dict[str, float | int]:
    """count, total, mean, median, p10, p90, min, max of durations in milliseconds."""
    if not ms:
        return {"count": 0}
    s = sorted(ms)

    def q(p: float) -> float:  # nearest-rank quantile
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {
        "count": len(s),
        "total_ms": round(sum(s), 4),
        "mean_ms": round(sum(s) / len(s), 4),
        "median_ms": round(statistics.median(s), 4),
        "p10_ms": round(q(0.1), 4),
        "p90_ms": round(q(0.9), 4),
        "min_ms": round(s[0], 4),
        "max_ms": round(s[-1], 4),
    }


class _Span(AbstractContextManager):
    __slots__ = ("annotation", "capturing", "name", "start", "t0", "timer")

    def __init__(self, timer: StageTimer, name: str) -> None:
        self.timer = timer
        self.name = name

    def __enter__(self) -> Self:
        t = time.perf_counter()
        self.start = None
        self.annotation = None
        if self.timer.annotate:  # a profiler range of the same name (bench/kernel_trace.py reads it)
            self.annotation = torch.profiler.record_function(ANNOTATION_PREFIX + self.name)
            self.annotation.__enter__()
        self.capturing = self.timer.use_cuda and torch.cuda.is_current_stream_capturing()
        if self.timer.use_cuda and not self.capturing:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()
        self.timer._own_s += self.t0 - t
        return self

    def __exit__(self, *exc: object) -> None:
        t = time.perf_counter()
        if self.annotation is not None:
            self.annotation.__exit__(None, None, None)
        if self.capturing:  # inside a CUDA-graph capture: nothing runs now, nothing to time
            return
        end = None
        if self.start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.timer._close(self.name, self.start, end, (t - self.t0) * 1e3)
        self.timer._own_s += time.perf_counter() - t


class StageTimer:
    """Spans per stage name; a disabled timer records nothing and costs one attribute check."""

    def __init__(self, enabled: bool, use_cuda: bool | None = None) -> None:
        self.enabled = enabled
        self.annotate = False  # also open a torch.profiler range per span (set_stage_timing(annotate=...))
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.reset()

    def reset(self) -> None:
        self._pending: list[tuple[str, Any, Any, float, int]] = []
        self._ms: dict[str, list[float]] = defaultdict(list)
        self._host_ms: dict[str, list[float]] = defaultdict(list)
        self._step_of: dict[str, list[int]] = defaultdict(list)  # the step of each span
        self._batch: list[tuple[int, int]] = []  # (requests, tokens) per execute_model
        self._own_s = 0.0  # host seconds spent inside the spans' own enter / exit
        self._t_reset = time.perf_counter()

    def span(self, name: str) -> AbstractContextManager:
        """A context manager timing ``name`` (the shared null context when disabled)."""
        if not self.enabled:
            return _NULL
        return _Span(self, name)

    def note_batch(self, num_reqs: int, num_tokens: int) -> None:
        """Batch shape of one scheduled step (requests, tokens); starts that step: the spans that
        follow belong to it."""
        if self.enabled:
            self._batch.append((int(num_reqs), int(num_tokens)))

    @property
    def step(self) -> int:
        """The step the next span belongs to: the number of steps noted so far (0 before any)."""
        return len(self._batch)

    def add(self, name: str, device_ms: float, host_ms: float | None = None, step: int | None = None) -> None:
        """Record one finished span directly (also how resolved events are folded in); ``step``
        defaults to the current one (:attr:`step`)."""
        self._ms[name].append(float(device_ms))
        self._host_ms[name].append(float(device_ms if host_ms is None else host_ms))
        self._step_of[name].append(self.step if step is None else int(step))

    def _close(self, name: str, start: Any, end: Any, host_ms: float) -> None:
        if start is None:
            self.add(name, host_ms, host_ms)
            return
        self._pending.append((name, start, end, host_ms, self.step))
        if len(self._pending) >= DRAIN_EVERY:
            self._drain(wait=len(self._pending) >= MAX_PENDING)

    def _drain(self, wait: bool = True) -> None:
        """Fold resolved event pairs in: all of them (``wait``: the host waits for the newest), or
        the oldest ones the device has already reached (one stream reaches them in order)."""
        if not self._pending:
            return
        done = 0
        for name, start, end, host_ms, step in self._pending:
            if wait:
                end.synchronize()  # complete long ago except for the newest few
            elif not end.query():
                break
            self.add(name, start.elapsed_time(end), host_ms, step)
            done += 1
        del self._pending[:done]

    def collect(self, reset: bool = False) -> dict[str, Any]:
        """Per-stage statistics (device and host milliseconds) since the last reset (module
        docstring: per span, per step, and sums over a step's layers)."""
        self._drain()
        steps = len(self._ms.get("execute_model", []))
        stages = {}
        for name in list(STAGES) + sorted(set(self._ms) - set(STAGES)):
            ms = self._ms.get(name)
            if not ms:
                continue
            entry: dict[str, Any] = summarize(ms)
            host = self._host_ms[name]
            entry["host_total_ms"] = round(sum(host), 4)
            entry["per_step_ms"] = round(sum(ms) / steps, 4) if steps else None
            entry["host_per_step_ms"] = round(sum(host) / steps, 4) if steps else None
            sums: dict[int, float] = defaultdict(float)
            for step, v in zip(self._step_of[name], ms, strict=True):
                sums[step] += v
            entry["spans_per_step"] = round(len(ms) / len(sums), 3)
            entry["per_step_sum"] = summarize(list(sums.values()))
            stages[name] = entry
        reqs = [b[0] for b in self._batch]
        out = {
            "enabled": self.enabled,
            "clock": "cuda_events" if self.use_cuda else "wall",
            "steps": steps,
            "seconds_since_reset": round(time.perf_counter() - self._t_reset, 4),
            "batch_requests": {"max": max(reqs), "mean": round(sum(reqs) / len(reqs), 3)} if reqs else None,
            "batch_tokens_mean": round(sum(b[1] for b in self._batch) / len(self._batch), 3) if self._batch else None,
            "timer_host_ms_per_step": round(self._own_s * 1e3 / steps, 4) if steps else None,
            "stages": stages,
        }
        if reset:
            self.reset()
        return out


TIMER = StageTimer(profiling_enabled())
"""The process's timer (enabled by ``VLLM_TFM_PROFILE`` when this module is first imported)."""


def collect_stage_timings(worker: Any = None, reset: bool = False) -> dict[str, Any]:
    """:meth:`StageTimer.collect` of this process; the signature suits ``LLM.collective_rpc``."""
    return TIMER.collect(reset=reset)


def set_stage_timing(worker: Any = None, enabled: bool | None = None, reset: bool = False,
                     annotate: bool | None = None) -> bool:
    """Pause / resume the spans (``enabled``) and drop what was recorded (``reset``); returns whether
    timing is on. Resuming works only where ``VLLM_TFM_PROFILE`` installed the runner hooks.
    ``annotate``: each span also opens a ``torch.profiler.record_function`` range named
    ``tfm:<stage>``, so that a profiler trace can tell which stage launched each kernel
    (``bench/e2e.py --kernel-profile``). The signature suits ``LLM.collective_rpc``."""
    if reset:
        TIMER.reset()
    if enabled is not None:
        TIMER.enabled = bool(enabled)
    if annotate is not None:
        TIMER.annotate = bool(annotate)
    return TIMER.enabled


def dump_stage_timings(path: str | Path, reset: bool = False) -> dict[str, Any]:
    """Write :func:`collect_stage_timings` to ``path`` as JSON and return it."""
    data = collect_stage_timings(reset=reset)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data

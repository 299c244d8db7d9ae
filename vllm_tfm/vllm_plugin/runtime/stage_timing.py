"""Per-stage timings of decode steps from CUDA events (``VLLM_TFM_PROFILE=1``), off by default.

When the switch is set in a process before the plugin installs its runtime hooks there, every
model runner of that process (tfm or not: the no-speculation and in-tree DFlash arms of a
benchmark are timed the same way) records a pair of CUDA events around each stage:

=====================  ====================================================================
``execute_model``      ``GPUModelRunner.execute_model``: input preparation, target forward, logits
``target_forward``     ``GPUModelRunner._model_forward``: the target model (for tfm: the tree verify)
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

Stages nest (``execute_model`` holds ``target_forward`` and ``prepare_tree``; ``sample_tokens``
holds ``sample``, ``commit`` and ``propose``; ``propose`` holds ``draft``, ``replay_shaping`` and
``tree_build``). An event pair measures the time between the device reaching the two events,
so a host-bound stage (eager launches) counts its launch time, which is what it costs a step.
Events are resolved lazily (at :meth:`StageTimer.collect`, or every :data:`DRAIN_EVERY` spans),
so timing adds no synchronisation inside a step. Without CUDA the spans fall back to wall time;
inside a CUDA-graph capture they record nothing.

Off means zero work: the extra runner hooks (``execute_model``, ``_model_forward``, ``_sample``)
are not installed at all, and the tfm-internal spans return one shared null context. Read the
numbers in the engine's worker with :func:`collect_stage_timings`, e.g. from the driver through
``LLM.collective_rpc(collect_stage_timings, kwargs={"reset": True})`` (vLLM calls it with the
worker as first argument; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the worker is in-process),
or write them to a JSON file with :func:`dump_stage_timings`.
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
    "PROFILE_ENV",
    "STAGES",
    "DRAIN_EVERY",
    "StageTimer",
    "TIMER",
    "profiling_enabled",
    "collect_stage_timings",
    "set_stage_timing",
    "dump_stage_timings",
    "summarize",
]

PROFILE_ENV = "VLLM_TFM_PROFILE"
STAGES = (
    "execute_model",
    "target_forward",
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
DRAIN_EVERY = 4096
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
    __slots__ = ("capturing", "name", "start", "t0", "timer")

    def __init__(self, timer: StageTimer, name: str) -> None:
        self.timer = timer
        self.name = name

    def __enter__(self) -> Self:
        self.t0 = time.perf_counter()
        self.start = None
        self.capturing = self.timer.use_cuda and torch.cuda.is_current_stream_capturing()
        if self.timer.use_cuda and not self.capturing:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.capturing:  # inside a CUDA-graph capture: nothing runs now, nothing to time
            return
        end = None
        if self.start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.timer._close(self.name, self.start, end, (time.perf_counter() - self.t0) * 1e3)


class StageTimer:
    """Spans per stage name; a disabled timer records nothing and costs one attribute check."""

    def __init__(self, enabled: bool, use_cuda: bool | None = None) -> None:
        self.enabled = enabled
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.reset()

    def reset(self) -> None:
        self._pending: list[tuple[str, Any, Any, float]] = []
        self._ms: dict[str, list[float]] = defaultdict(list)
        self._host_ms: dict[str, list[float]] = defaultdict(list)
        self._batch: list[tuple[int, int]] = []  # (requests, tokens) per execute_model
        self._t_reset = time.perf_counter()

    def span(self, name: str) -> AbstractContextManager:
        """A context manager timing ``name`` (the shared null context when disabled)."""
        if not self.enabled:
            return _NULL
        return _Span(self, name)

    def note_batch(self, num_reqs: int, num_tokens: int) -> None:
        """Batch shape of one scheduled step (requests, tokens)."""
        if self.enabled:
            self._batch.append((int(num_reqs), int(num_tokens)))

    def add(self, name: str, device_ms: float, host_ms: float | None = None) -> None:
        """Record one finished span directly (also how resolved events are folded in)."""
        self._ms[name].append(float(device_ms))
        self._host_ms[name].append(float(device_ms if host_ms is None else host_ms))

    def _close(self, name: str, start: Any, end: Any, host_ms: float) -> None:
        if start is None:
            self.add(name, host_ms, host_ms)
            return
        self._pending.append((name, start, end, host_ms))
        if len(self._pending) >= DRAIN_EVERY:
            self._drain()

    def _drain(self) -> None:
        if not self._pending:
            return
        for name, start, end, host_ms in self._pending:
            end.synchronize()  # complete long ago except for the newest few
            self.add(name, start.elapsed_time(end), host_ms)
        self._pending = []

    def collect(self, reset: bool = False) -> dict[str, Any]:
        """Per-stage statistics (device and host milliseconds) since the last reset."""
        self._drain()
        steps = len(self._ms.get("execute_model", []))
        stages = {}
        for name in list(STAGES) + sorted(set(self._ms) - set(STAGES)):
            ms = self._ms.get(name)
            if not ms:
                continue
            entry = summarize(ms)
            entry["host_total_ms"] = round(sum(self._host_ms[name]), 4)
            entry["per_step_ms"] = round(sum(ms) / steps, 4) if steps else None
            stages[name] = entry
        reqs = [b[0] for b in self._batch]
        out = {
            "enabled": self.enabled,
            "clock": "cuda_events" if self.use_cuda else "wall",
            "steps": steps,
            "seconds_since_reset": round(time.perf_counter() - self._t_reset, 4),
            "batch_requests": {"max": max(reqs), "mean": round(sum(reqs) / len(reqs), 3)} if reqs else None,
            "batch_tokens_mean": round(sum(b[1] for b in self._batch) / len(self._batch), 3) if self._batch else None,
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


def set_stage_timing(worker: Any = None, enabled: bool | None = None, reset: bool = False) -> bool:
    """Pause / resume the spans (``enabled``) and drop what was recorded (``reset``); returns whether
    timing is on. Resuming works only where ``VLLM_TFM_PROFILE`` installed the runner hooks.
    The signature suits ``LLM.collective_rpc``."""
    if reset:
        TIMER.reset()
    if enabled is not None:
        TIMER.enabled = bool(enabled)
    return TIMER.enabled


def dump_stage_timings(path: str | Path, reset: bool = False) -> dict[str, Any]:
    """Write :func:`collect_stage_timings` to ``path`` as JSON and return it."""
    data = collect_stage_timings(reset=reset)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data

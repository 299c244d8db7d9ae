"""Per-request event trace of a tfm engine: ``VLLM_TFM_TRACE=<dir>`` (a debugging switch).

With the switch set where the engine starts (``vllm serve``, ``LLM(...)``; vLLM's executors pass
the environment to their workers), tensor-parallel rank 0 of a tfm engine writes, for every step
and every request in the batch, one JSON line to ``<dir>/trace-<pid>.jsonl`` (one file per engine
process; the first line is a ``{"trace": "vllm-tfm", ...}`` header). The records say what the
runtime saw and decided for the request, so a wrong token can be traced to its step:

=========  ===============================================================================
key        meaning
=========  ===============================================================================
``s``      step index of this engine (one per model-runner step with scheduled tokens)
``ts``     seconds since the trace started (host clock at the step's ``_prepare_inputs``)
``r``      vLLM's request id (the engine's internal one: ``<external id>-<8 hex>``)
``row``    batch row; ``n`` scheduled tokens; ``d`` scheduled drafts
``spec``   1 if vLLM verifies the row as a spec decode (``scheduled_spec_decode_tokens`` and
           ``n == d + 1``)
``tree``   1 if the row verified a non-chain tree; ``dep`` its depth
``lk``     how the drafts matched the stored proposal (``state.LOOKUP_NAMES``): ``full``,
           ``cut`` (a prefix: the scheduler truncated the tree), ``miss`` (not a prefix:
           zeroed or stale drafts, verified as a chain), ``absent``, ``off`` (trees off this
           step); ``prop`` the stored proposal's length
``path``   how the step was verified: ``tree`` (tfm's tree sampler), ``chains`` (vLLM's
           rejection sampler: no request had a non-chain tree), ``sampler`` (vLLM's rejection
           sampler because the batch needs vLLM's sampler: ``needs_native_sampler``), ``plain``
           (no drafts in the step)
``new``    1: the request is new this step; ``res`` 1: resumed after a preemption (recompute);
           ``back`` 1: re-added to the batch after being left out of the previous step
``a0``     vLLM's ``num_accepted_tokens`` of the row as read this step (hybrid models), ``a``
           the value used after the offsets fix-up; ``fix`` ``restore`` / ``move`` when the fix-up
           acted on the row (``accepted_offsets.py``)
``nc``     computed tokens before the step; ``no`` output tokens before the step (so the step's
           tokens are output positions ``no .. no + len(out) - 1``)
``t``      the request's temperature (0: greedy)
``acc``    drafts accepted; ``out`` the tokens the step emitted for the request (accepted path,
           then the bonus); ``disc`` 1 when vLLM discards them (a partial prefill chunk)
=========  ===============================================================================

Cost: with the switch off, one attribute test per hook. On: one device-to-host read of the
step's sampled tokens (a sync) and one line per request; lines are buffered and written when
256 KiB are pending or a second has passed (and at process exit), and the file stops at
``VLLM_TFM_TRACE_MAX_MB`` (default 256) with a ``{"truncated": ...}`` line.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Sequence
from multiprocessing import util as mp_util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .state import LOOKUP_CUT, LOOKUP_FULL, LOOKUP_NAMES, StepTree

if TYPE_CHECKING:
    from torch import Tensor

    from .accepted_offsets import OffsetPlan

__all__ = ["TRACE_VERSION", "Tracer", "finish_records", "step_path", "step_records"]

TRACE_VERSION = 1
FLUSH_BYTES = 256 << 10
FLUSH_SECONDS = 1.0


def step_path(step: StepTree, native_sampler: bool) -> str:
    """How the step was verified (the ``path`` key of the module docstring)."""
    if step.tree_active:
        return "tree"
    if not bool((step.is_spec & (step.num_draft > 0)).any()):
        return "plain"
    return "sampler" if native_sampler else "chains"


def step_records(
    step_index: int,
    req_ids: Sequence[str],
    step: StepTree,
    *,
    native_sampler: bool,
    new: set[str] | frozenset[str],
    resumed: set[str] | frozenset[str],
    last: set[str] | None,
    num_computed: np.ndarray,
    num_output: Sequence[int],
    temperature: np.ndarray,
    accepted_read: np.ndarray | None = None,
    accepted_used: np.ndarray | None = None,
    plan: OffsetPlan | None = None,
    t: float = 0.0,
) -> list[dict[str, Any]]:
    """The records of one step before sampling, one per request in batch order.

    ``last``: the request ids of the previous traced step (None: no previous step, no ``back``);
    ``accepted_read`` / ``accepted_used``: [R] vLLM's ``num_accepted_tokens`` before / after the
    offsets fix-up (None for models without GDN state); ``plan``: the fix-up's plan, if it acted.
    """
    if len(req_ids) != step.num_reqs:
        raise ValueError(f"{len(req_ids)} request ids for a step of {step.num_reqs} requests")
    path = step_path(step, native_sampler)
    fixes: dict[int, str] = {}
    if plan is not None:
        fixes.update({i: "restore" for i in plan.restore_rows})
        fixes.update({i: "move" for i in plan.move_rows})
    qs = step.query_start
    out = []
    for i, rid in enumerate(req_ids):
        rec: dict[str, Any] = {
            "s": step_index, "ts": round(t, 3), "r": rid, "row": i, "n": int(step.num_scheduled[i]),
            "d": int(step.num_draft[i]), "spec": int(step.is_spec[i]), "path": path,
        }  # fmt: skip
        if step.is_tree[i]:
            rec["tree"] = 1
            rec["dep"] = int(step.depth[qs[i] : qs[i + 1]].max())
        code = int(step.lookup[i]) if step.lookup is not None else 0
        if code:
            rec["lk"] = LOOKUP_NAMES[code]
            if code in (LOOKUP_FULL, LOOKUP_CUT) and step.proposal_len is not None:
                rec["prop"] = int(step.proposal_len[i])
        if rid in new:
            rec["new"] = 1
        elif rid in resumed:
            rec["res"] = 1
        elif last is not None and rid not in last:
            rec["back"] = 1
        if accepted_read is not None:
            rec["a0"] = int(accepted_read[i])
            rec["a"] = int(accepted_used[i]) if accepted_used is not None else int(accepted_read[i])
        if i in fixes:
            rec["fix"] = fixes[i]
        rec["nc"] = int(num_computed[i])
        rec["no"] = int(num_output[i])
        rec["t"] = round(float(temperature[i]), 4)
        out.append(rec)
    return out


def finish_records(records: list[dict[str, Any]], sampled: np.ndarray, discard: np.ndarray | None = None) -> None:
    """Add what sampling gave each request: ``acc``, ``out`` and ``disc`` (in place).

    sampled: [R, W] vLLM's ``sampled_token_ids`` of the step (accepted drafts, the bonus, then -1).
    """
    for rec in records:
        row = sampled[rec["row"]]
        k = int((row != -1).sum())  # as vLLM counts num_accepted_tokens (gpu_model_runner.py:1563)
        rec["acc"] = max(k - 1, 0)
        rec["out"] = [int(x) for x in row[:k]]
        if discard is not None and bool(discard[rec["row"]]):
            rec["disc"] = 1


class Tracer:
    """Writes the records of each step of one engine (module docstring)."""

    def __init__(self, directory: str | Path, max_bytes: int, header: dict[str, Any] | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"trace-{os.getpid()}.jsonl"
        self.max_bytes = int(max_bytes)
        self.step_index = 0
        self.written = 0
        self.stopped = False
        self._t0 = time.monotonic()
        self._last_flush = self._t0
        self._buf: list[str] = []
        self._buf_bytes = 0
        self._last_ids: set[str] | None = None
        self._pending: list[dict[str, Any]] | None = None
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the engine's life
        head = {"trace": "vllm-tfm", "version": TRACE_VERSION, "pid": os.getpid(), "time": time.time(),
                "max_bytes": self.max_bytes, **(header or {})}  # fmt: skip
        self._emit(json.dumps(head, separators=(",", ":")))
        self.flush()
        atexit.register(self.close)
        # engine-core processes end through multiprocessing, which runs its finalizers, not atexit
        mp_util.Finalize(self, self.close, exitpriority=10)

    @classmethod
    def from_settings(cls, header: dict[str, Any] | None = None) -> Tracer | None:
        """A tracer when ``VLLM_TFM_TRACE`` is set (``settings.trace_settings``), else None."""
        from .settings import trace_settings

        cfg = trace_settings()
        return None if cfg is None else cls(cfg[0], cfg[1], header)

    # ------------------------------------------------------------------ one step
    def begin(
        self,
        runner: Any,
        scheduler_output: Any,
        step: StepTree,
        native_sampler: bool,
        accepted_read: np.ndarray | None = None,
        plan: OffsetPlan | None = None,
    ) -> None:
        """Build the step's records from the runner's batch (after ``_prepare_inputs``)."""
        if self.stopped:
            return
        batch = runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        resumed = set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        requests = runner.requests
        num_output = [len(requests[rid].output_token_ids) if rid in requests else 0 for rid in req_ids]
        used = runner.num_accepted_tokens.np[:n].copy() if accepted_read is not None else None
        self._pending = step_records(
            self.step_index, req_ids, step, native_sampler=native_sampler, new=new, resumed=resumed, last=self._last_ids,
            num_computed=batch.num_computed_tokens_cpu[:n], num_output=num_output, temperature=batch.temperature_cpu[:n],
            accepted_read=accepted_read, accepted_used=used, plan=plan, t=time.monotonic() - self._t0,
        )  # fmt: skip
        self._last_ids = set(req_ids)
        self.step_index += 1

    def end(self, runner: Any, sampled_token_ids: Tensor) -> None:
        """Complete the step's records with the sampled tokens and buffer them (a host sync)."""
        records, self._pending = self._pending, None
        if records is None or self.stopped:
            return
        sampled = sampled_token_ids.detach().to("cpu").numpy()
        mask = getattr(runner, "discard_request_mask", None)
        discard = None if mask is None else np.asarray(mask.np[: sampled.shape[0]])
        finish_records(records, sampled, discard)
        for rec in records:
            self._emit(json.dumps(rec, separators=(",", ":")))
        now = time.monotonic()
        if self._buf_bytes >= FLUSH_BYTES or now - self._last_flush >= FLUSH_SECONDS:
            self.flush()

    # ------------------------------------------------------------------ output
    def _emit(self, line: str) -> None:
        if self.stopped:
            return
        size = len(line) + 1
        if self.written + self._buf_bytes + size > self.max_bytes:
            self._buf.append(json.dumps({"truncated": True, "step": self.step_index, "max_bytes": self.max_bytes}))
            self.flush()
            self.stopped = True
            return
        self._buf.append(line)
        self._buf_bytes += size

    def flush(self) -> None:
        """Write what is buffered (idempotent)."""
        self._last_flush = time.monotonic()
        if not self._buf or self._file is None:
            return
        text = "\n".join(self._buf) + "\n"
        self._buf, self._buf_bytes = [], 0
        self._file.write(text)
        self._file.flush()
        self.written += len(text)

    def close(self) -> None:
        if self._file is None:
            return
        self.flush()
        self._file.close()
        self._file = None
        self.stopped = True

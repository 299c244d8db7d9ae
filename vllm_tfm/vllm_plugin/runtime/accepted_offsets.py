"""Where each request's committed GDN state sits, kept across vLLM's persistent-batch removals.

vLLM 0.26's spec decoding on hybrid models (mamba_cache_mode "none") keeps the state after the
last accepted token in SSM slot ``[n, a - 1]`` and the conv window at columns ``a - 1 ..`` of
slot ``[n, 0]``, with ``a`` the previous step's ``num_accepted_tokens``, stored per batch row in
``InputBatch.num_accepted_tokens_cpu``. The tree commit writes the same layout (commit.py). Two
scheduler situations, both met under memory pressure, break that bookkeeping:

1. A running request that the scheduler leaves out of a step (its running loop stops after a
   preemption or when the token budget runs out) is removed from the persistent batch
   (gpu_model_runner.py:1229) and re-added when it is scheduled again, and ``add_request``
   (gpu_input_batch.py:469) resets its ``num_accepted_tokens`` to 1 while its state still sits
   at ``a - 1``: the next step would start from slot ``[n, 0]``, a stale state. (The request
   keeps its blocks and its drafts; it is not a preemption.)
2. A running request scheduled without any of its drafts is a non-spec row, for which vLLM's GDN
   reads slot ``[n, 0]`` and conv columns ``0 ..`` whatever ``a`` was.

``AcceptedOffsets`` remembers ``a`` per request id across steps. Each step, after vLLM's
``_prepare_inputs``, rows of case 1 that verify drafts get their ``a`` back (``plan``:
``restore``), and rows that read slot 0 while their state sits elsewhere (case 2, or case 1
without drafts) have the state moved to slot ``[n, 0]`` / conv columns ``0 ..`` in every GDN layer
and ``a = 1`` (``move``, ``move_states_to_slot0``). Requests preempted and resumed recompute their
state with a prefill into slot 0, so their record is dropped when they resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

__all__ = ["AcceptedOffsets", "OffsetPlan", "move_states_to_slot0", "plan_offsets"]


@dataclass
class OffsetPlan:
    """Rows (batch indices) to fix this step and the ``a`` each one really has; ``device_move_rows``:
    rows moved to slot 0 from the device's ``a`` (asynchronous scheduling, ``hooks.fix_accepted_offsets``)."""

    restore_rows: list[int] = field(default_factory=list)
    restore_values: list[int] = field(default_factory=list)
    move_rows: list[int] = field(default_factory=list)
    move_from: list[int] = field(default_factory=list)
    device_move_rows: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.restore_rows or self.move_rows or self.device_move_rows)


def plan_offsets(
    req_ids: list[str],
    current: np.ndarray,
    continuing: np.ndarray,
    spec_rows: np.ndarray,
    decode_rows: np.ndarray,
    records: dict[str, int],
) -> OffsetPlan:
    """What to fix this step (module docstring); pops the records it uses.

    req_ids: the batch's request ids, row order; current: [R] vLLM's ``num_accepted_tokens`` of
    the rows; continuing: [R] bool, the row was in vLLM's batch last step too (its ``current`` is
    right); spec_rows: [R] bool, the row verifies drafts this step (vLLM reads slot ``a - 1``);
    decode_rows: [R] bool, the row decodes from a committed state (not a prefill from scratch or
    a prefill chunk); records: ``a`` of the requests that left the batch while decoding.
    """
    plan = OffsetPlan()
    for i, rid in enumerate(req_ids):
        true_a = int(current[i]) if continuing[i] else records.pop(rid, int(current[i]))
        if not decode_rows[i]:
            continue
        if spec_rows[i]:
            if true_a != int(current[i]):
                plan.restore_rows.append(i)
                plan.restore_values.append(true_a)
        elif true_a > 1:
            plan.move_rows.append(i)
            plan.move_from.append(true_a)
    return plan


def move_states_to_slot0(
    conv_states: list[Tensor], ssm_states: list[Tensor], slots: Tensor, accepted: Tensor, width: int
) -> None:
    """Move the committed state of some requests to SSM slot ``[n, 0]`` and conv columns ``0 ..``.

    conv_states: per GDN layer ``[slots, conv_dim, L]`` (dim-first view), ssm_states: per layer
    ``[slots, ...]``; slots: [M, 1 + S] int64, the requests' state slots; accepted: [M] int64,
    their ``a`` (>= 1); width: conv kernel width W (the window is W - 1 columns).
    """
    if slots.numel() == 0:
        return
    dev = slots.device
    a = accepted.to(device=dev, dtype=torch.long)
    src = slots.gather(1, (a - 1)[:, None]).squeeze(1)
    dst = slots[:, 0]
    cols = (a - 1)[:, None] + torch.arange(width - 1, device=dev)[None, :]  # [M, W - 1]
    for conv, ssm in zip(conv_states, ssm_states, strict=True):
        ssm[dst] = ssm[src]  # the right side is a copy: reads before writes
        window = conv[dst].gather(2, cols[:, None, :].expand(-1, conv.shape[1], -1))  # [M, conv_dim, W - 1]
        conv[dst, :, : width - 1] = window


class AcceptedOffsets:
    """``a`` of the requests that left vLLM's persistent batch while decoding (module docstring)."""

    def __init__(self) -> None:
        self.records: dict[str, int] = {}
        self.reported = False  # the first fix is logged once
        self._last_ids: list[str] = []
        self._last_values: Tensor | None = None  # vLLM's num_accepted_tokens after the last step, on the device

    def end_step(self, req_ids: list[str], num_accepted: Tensor) -> None:
        """After a step's accepted counts were set: keep them (a device copy; no sync)."""
        self._last_ids = list(req_ids)
        self._last_values = num_accepted[: len(req_ids)].clone()

    def begin_step(self, req_ids: list[str], resumed: set[str], live: set[str] | dict) -> np.ndarray:
        """Before a step: record the requests that left the batch, forget the resumed and finished
        ones; returns ``continuing`` [R] for ``req_ids``. The usual step (the same requests in the
        same order, none resumed, nothing recorded) costs one list comparison."""
        if not resumed and not self.records and req_ids == self._last_ids:
            return np.ones(len(req_ids), dtype=bool)
        now = set(req_ids)
        # finished and aborted requests are gone from ``live`` already: only a request that left while
        # still running costs the host sync below
        left = [j for j, rid in enumerate(self._last_ids) if rid not in now and rid not in resumed and rid in live]
        if left and self._last_values is not None:
            values = self._last_values.tolist()  # host sync, only on steps where a running request left
            for j in left:
                self.records[self._last_ids[j]] = int(values[j])
        for rid in [r for r in self.records if r in resumed or r not in live]:
            del self.records[rid]
        last = set(self._last_ids)
        return np.array([rid in last and rid not in resumed for rid in req_ids], dtype=bool)

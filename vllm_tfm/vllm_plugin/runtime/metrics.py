"""Tree acceptance and hook counters of the tfm runtime (worker side).

vLLM's own spec-decode statistics already describe trees correctly: the sampler returns the
accepted path (p tokens) plus the bonus, so the scheduler's ``SpecDecodingStats`` records p
accepted drafts per step and its per-position counters are acceptance by depth (position k =
depth k + 1); ``mean acceptance length = 1 + accepted / drafts`` is the tree's mean accepted
length. What vLLM cannot know is tree-specific: how many steps verified real trees, their node
counts and depth, which hooks ran, and where the time went. ``Metrics`` keeps those on the worker,
with the accepted-depth histogram on the device (no sync per step); ``snapshot()`` reads them.

Per-stage timings are wall-clock around each hook; with ``profile = True`` each stage first
synchronises the device so the numbers are the stage's own GPU time (the GPU bench sets it).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_tfm.verify.accept_result import AcceptResult

    from .state import StepTree

__all__ = ["Metrics"]


class Metrics:
    """Counters since construction (or the last ``reset``)."""

    def __init__(self, max_depth: int, device: torch.device | str = "cpu") -> None:
        self.max_depth = max_depth
        self.device = device
        self.profile = False
        self.reset()

    def reset(self) -> None:
        self.hooks: Counter[str] = Counter()
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.tree_steps = 0
        self.tp_tree_checks = 0  # proposals found identical on every TP rank (VLLM_TFM_CHECK_TP_TREES)
        self.tp_accept_checks = 0  # verifications found identical on every TP rank
        self.accepted_restored = 0  # rows whose num_accepted_tokens vLLM reset on re-adding them (accepted_offsets.py)
        # rows whose committed GDN state was moved to slot 0 (accepted_offsets.py; with asynchronous scheduling every
        # continuing row scheduled one token, moved from the device's count, a copy onto itself where that was 1)
        self.states_moved = 0
        # steps whose drafts went to the scheduler as placeholders (deferred_drafts.py; 0 with asynchronous
        # scheduling, whose scheduler makes its own)
        self.placeholder_steps = 0
        self.placeholder_drafts_filled = 0  # draft input ids written from the proposals (deferred_drafts.py)
        self.resumed: Counter[str] = Counter()  # request id -> times vLLM resumed it after a preemption
        self.tree_requests = 0
        self.tree_nodes = 0
        self.spec_requests = 0
        # accepted drafts per verified spec request, on the device: [max_depth + 1]
        self._accepted_hist = torch.zeros(self.max_depth + 1, dtype=torch.long, device=self.device)
        self.last_shapes: dict[str, object] = {}
        self._report_t: float | None = None  # interval_report: time and counters of the last report
        self._report_base: tuple[int, int, Counter[str], dict[str, float]] = (0, 0, Counter(), {})

    def hook(self, name: str) -> None:
        self.hooks[name] += 1

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        if self.profile and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.profile and torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[stage] += time.perf_counter() - t0

    def record_step(self, step: "StepTree") -> None:
        self.steps += 1
        if step.tree_active:
            self.tree_steps += 1
            self.tree_requests += int(step.is_tree.sum())
            self.tree_nodes += int((step.num_draft * step.is_tree).sum())
        self.last_shapes = {
            "num_reqs": step.num_reqs,
            "num_tokens": step.num_tokens,
            "num_draft": step.num_draft.tolist(),
            "is_tree": step.is_tree.astype(int).tolist(),
            "tree_active": step.tree_active,
        }

    def record_accept(self, step: "StepTree", result: "AcceptResult") -> None:
        """Histogram of accepted drafts over the spec requests of a verified step (device only)."""
        idx = step.dev("spec_req_index")
        acc = result.num_accepted.index_select(0, idx).clamp(max=self.max_depth)
        self.spec_requests += step.num_spec_reqs
        self._accepted_hist.index_add_(0, acc.to(self._accepted_hist.device), torch.ones_like(acc, device=self._accepted_hist.device))

    def interval_report(
        self, now: float, interval_s: float, memory: Callable[[], tuple[float, float]] | None = None
    ) -> str | None:
        """One log line on the steps since the last report, once ``interval_s`` has passed (else None).

        Counts are exact; the per-step times are host wall-clock per stage (device time only with
        ``profile``), which is what shows Python overhead on the hot path. ``memory`` (called only
        when a line is made): the torch caching allocator's (allocated, reserved) MiB of the
        process, appended as ``GPU MiB allocated A, reserved R`` (what nvidia-smi's per-process
        figure holds besides is CUDA context, kernel modules and other non-torch memory).
        """
        if self._report_t is None:
            self._report_t = now
            return None
        if now - self._report_t < interval_s:
            return None
        steps0, trees0, hooks0, secs0 = self._report_base
        steps, trees = self.steps - steps0, self.tree_steps - trees0
        span = now - self._report_t
        self._report_t = now
        self._report_base = (self.steps, self.tree_steps, Counter(self.hooks), dict(self.seconds))
        if steps <= 0:
            return None

        def moved(prefix: str) -> dict[str, int]:  # hook counters of the interval under ``prefix``, those that moved
            counts = {k[len(prefix):]: v - hooks0.get(k, 0) for k, v in sorted(self.hooks.items()) if k.startswith(prefix)}
            return {k: v for k, v in counts.items() if v > 0}

        proposals = {k: v for k, v in moved("proposer.").items() if k != "context_reorder"}
        per_step = {k: (v - secs0.get(k, 0.0)) * 1e3 / steps for k, v in sorted(self.seconds.items())}
        graphs = moved("cudagraph.")
        line = (
            f"vllm-tfm: last {span:.1f} s: {steps} steps, {trees} with trees; proposals: "
            + (", ".join(f"{k} {v}" for k, v in proposals.items()) or "none")
            + "; host ms per step: "
            + (", ".join(f"{k} {v:.1f}" for k, v in per_step.items() if v > 0) or "none")
        )
        if graphs:  # steps by the CUDA graph they replayed (docs/metrics.md, `cudagraph.*`)
            line += "; graphs: " + ", ".join(f"{k} {v}" for k, v in graphs.items())
        if memory is not None:
            allocated, reserved = memory()
            line += f"; GPU MiB allocated {allocated:.0f}, reserved {reserved:.0f}"
        return line

    def snapshot(self) -> dict:
        """Plain-Python summary (reads the device histogram once)."""
        hist = self._accepted_hist.tolist()
        n = sum(hist)
        accepted = sum(k * c for k, c in enumerate(hist))
        # requests that accepted at least d drafts, d = 1..max_depth
        at_least = [sum(hist[d:]) for d in range(1, len(hist))]
        return {
            "steps": self.steps,
            "tree_steps": self.tree_steps,
            "tp_tree_checks": self.tp_tree_checks,
            "tp_accept_checks": self.tp_accept_checks,
            "accepted_restored": self.accepted_restored,
            "states_moved": self.states_moved,
            "placeholder_steps": self.placeholder_steps,
            "placeholder_drafts_filled": self.placeholder_drafts_filled,
            "resumed_requests": dict(self.resumed),
            "tree_requests": self.tree_requests,
            "tree_nodes": self.tree_nodes,
            "verified_spec_requests": n,
            "mean_accepted_length": (1.0 + accepted / n) if n else None,
            "accepted_hist": hist,
            "acceptance_by_depth": [c / n for c in at_least] if n else [],
            "hooks": dict(self.hooks),
            "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
            "last_shapes": self.last_shapes,
        }

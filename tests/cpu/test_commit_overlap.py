"""A tree step's commit on its own stream beside the drafting (runtime/commit_overlap.py): where the runner
hooks fork and join, and the switch. The streams themselves run in tests/gpu/test_commit_overlap_gpu.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_tfm.vllm_plugin.runtime import hooks
from vllm_tfm.vllm_plugin.runtime.commit_overlap import (
    COMMIT_OVERLAP_ENV,
    CommitOverlap,
    commit_overlap_from_env,
    set_commit_overlap,
)
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.state import STATE


class _Recorder:
    """``CommitOverlap`` as the hooks use it, writing what happens, in order, into ``events``."""

    def __init__(self, events: list[tuple[Any, ...]], side: bool) -> None:
        self.events, self._side = events, side

    @contextmanager
    def side(self, device: torch.device | None, *held: Any) -> Iterator[bool]:
        self.events.append(("fork", device, held))
        yield self._side
        self.events.append(("fork end",))

    def join(self) -> bool:
        self.events.append(("join",))
        return True


@pytest.mark.parametrize("side", [True, False])
def test_the_commit_runs_inside_the_fork_and_the_step_joins_after_the_drafting(monkeypatch: pytest.MonkeyPatch,
                                                                               side: bool) -> None:
    """The commit is queued inside the fork, which holds the step and its sampled tokens; the proposal's hook joins
    after the drafting is queued, and ``sample_tokens`` joins again at its end (nothing left to join then, but a
    step that drafted nothing joins there). ``commit.overlap`` counts the commits that went to the commit stream."""
    events: list[tuple[Any, ...]] = []
    monkeypatch.setattr(hooks, "OVERLAP", _Recorder(events, side))
    monkeypatch.setattr(hooks, "commit_step", lambda runner, step, tokens: events.append(("commit", step, tokens)))
    monkeypatch.setattr(hooks, "early_sampled_copy_enabled", lambda: False)
    saved = STATE.step, STATE.trace, STATE.metrics, STATE.one_slot
    step = SimpleNamespace(tree_active=True, tree_gdn=True)
    STATE.step, STATE.trace, STATE.metrics, STATE.one_slot = step, None, Metrics(4), True
    try:
        device = torch.device("cuda", 0)
        runner = SimpleNamespace(_tfm_enabled=True, device=device, model_config=SimpleNamespace(is_hybrid=True),
                                 input_batch=SimpleNamespace(sampling_metadata=None))
        sampled = torch.tensor([[5, 6, -1]], dtype=torch.int32)
        hooks._wrap_update_states_after(lambda self, o, s: events.append(("vllm update", o)))(runner, sampled, None)
        assert events == [("fork", device, (step, sampled)), ("commit", step, sampled), ("fork end",),
                          ("vllm update", sampled)]
        assert STATE.metrics.hooks.get("commit.overlap", 0) == (1 if side else 0)
        events.clear()
        monkeypatch.setattr(hooks, "record_sampled_copy", lambda *a, **k: None)
        propose = hooks._wrap_propose(lambda self, *a, **k: events.append(("drafting",)) or "drafts")
        assert propose(runner, None, sampled, None, None, None) == "drafts"
        assert events == [("drafting",), ("join",)]
        events.clear()
        sample_tokens = hooks._wrap_sample_tokens(lambda self: events.append(("sample_tokens",)) or "out")
        assert sample_tokens(runner) == "out"
        assert events == [("sample_tokens",), ("join",)] and STATE.step is None
    finally:
        STATE.step, STATE.trace, STATE.metrics, STATE.one_slot = saved


def test_a_drafting_that_raises_still_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[Any, ...]] = []
    monkeypatch.setattr(hooks, "OVERLAP", _Recorder(events, True))
    monkeypatch.setattr(hooks, "record_sampled_copy", lambda *a, **k: None)
    saved = STATE.metrics
    STATE.metrics = Metrics(4)

    def drafting(self: Any, *a: Any, **k: Any) -> None:
        raise RuntimeError("the drafter failed")

    try:
        runner = SimpleNamespace(_tfm_enabled=True)
        with pytest.raises(RuntimeError, match="the drafter failed"):
            hooks._wrap_propose(drafting)(runner, None, None, None, None, None)
        assert events == [("join",)]
    finally:
        STATE.metrics = saved


def test_off_cuda_or_switched_off_the_commit_runs_on_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """No commit stream is made or waited for: not on a CUDA device, or with the switch off (its default; then not
    even for a CUDA device, so this runs without one). The setter's override wins over the environment until reset, and a
    bad value is refused with its message."""
    overlap = CommitOverlap()
    monkeypatch.setenv(COMMIT_OVERLAP_ENV, "1")
    for device in (torch.device("cpu"), "cpu", None):
        with overlap.side(device, "held") as side:
            assert side is False
        assert not overlap.pending and overlap.join() is False
    for setting in ("0", None):  # off by default
        if setting is None:
            monkeypatch.delenv(COMMIT_OVERLAP_ENV)
        else:
            monkeypatch.setenv(COMMIT_OVERLAP_ENV, setting)
        with overlap.side(torch.device("cuda", 0)) as side:
            assert side is False
        assert not overlap.pending
    assert commit_overlap_from_env({COMMIT_OVERLAP_ENV: "1"}) and not commit_overlap_from_env({})
    monkeypatch.setenv(COMMIT_OVERLAP_ENV, "0")
    try:
        from vllm_tfm.vllm_plugin.runtime import set_commit_overlap as runtime_setter

        assert runtime_setter(None, True) is True  # the collective_rpc form; wins over the environment's 0
        assert set_commit_overlap(False) is False
        with pytest.raises(ValueError, match="set_commit_overlap takes True, False or None, got 1"):
            set_commit_overlap(1)  # type: ignore[arg-type]
    finally:
        assert set_commit_overlap(None) is False  # back to the environment's 0

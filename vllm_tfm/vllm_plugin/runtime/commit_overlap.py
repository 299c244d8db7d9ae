"""A tree step's commit on its own CUDA stream, beside the drafting (``VLLM_TFM_COMMIT_OVERLAP``).

The commit (``hooks.commit_step``: the K/V compaction of the accepted paths and the GDN commit of every
layer) writes the target's KV caches, GDN states and conv windows, which nothing reads before the next
step's forward; the drafting queued after it (the DFlash forward on the target's hidden states, the
Weaver build) reads none of them. On one stream the drafting still waits for the commit: at batch 8 of
the 27B shape the commit is ~1 ms of state traffic, queued before ~4 ms of
drafting whose Weaver part is bound by kernel latency, not bytes (0.95 of 26.6 ms a step on an H200,
bench/NOTES.md section 68). Measured at the 27B shape on an H100 (section 70), the overlap does not shorten a
step beyond a same-engine A/B's ~0.3 ms resolution at batch 1 or 8 (likely: the commit's traffic competes with
the drafting's weight reads instead of filling idle time; not traced), so it stays opt-in. Here:

* fork (:meth:`CommitOverlap.side`): the commit stream waits for everything the current stream has
  queued so far (the forward, the sampler's acceptance), then the commit's kernels are queued on it;
* join (:meth:`CommitOverlap.join`): the current stream waits for the commit's end. ``hooks.py`` joins
  when the drafting is queued (the end of ``propose_draft_token_ids``) and, for a step that drafted
  nothing or raised, at the end of ``sample_tokens``. Everything queued on the current stream after
  that (the next step's slot mappings, the forward that reads the caches and states) runs after the
  commit.

Memory. The commit reads tensors made on the current stream (the step's tables and stash, the sampled
tokens). Freed on the host before the commit ran, the caching allocator could hand their memory to work
of the current stream that runs first; so the fork holds references to them (``held``) until the join.
Tensors the commit makes belong to the commit stream; every use of that stream begins with a fork, so
any later reuse of their memory there is ordered after the current stream's work queued before it.

Off (the default; ``VLLM_TFM_COMMIT_OVERLAP=1`` or ``set_commit_overlap(True)`` turns it on) or off CUDA the
commit runs on the current stream, as before. The same kernels on the same inputs either way, so the same states.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from .settings import RuntimeSwitch

__all__ = ["COMMIT_OVERLAP_ENV", "OVERLAP", "CommitOverlap", "commit_overlap_enabled", "commit_overlap_from_env",
           "set_commit_overlap"]

COMMIT_OVERLAP_ENV = "VLLM_TFM_COMMIT_OVERLAP"
_SWITCH = RuntimeSwitch(COMMIT_OVERLAP_ENV, "set_commit_overlap", default_on=False)


def commit_overlap_enabled() -> bool:
    """``VLLM_TFM_COMMIT_OVERLAP`` set to 1 / true (default off: no gain measured at the 27B shape; the toy zoo's
    tokens with it equal no-spec's, synchronous and asynchronous, bench/NOTES.md section 70), unless
    ``set_commit_overlap`` overrode it: a tree step's commit runs on its own CUDA stream beside the drafting (module
    docstring)."""
    return _SWITCH.enabled()


def commit_overlap_from_env(environ: Mapping[str, str]) -> bool:
    """What ``commit_overlap_enabled`` says in a process with this environment and no override (the benches'
    verdicts on their engines)."""
    return _SWITCH.enabled_in(environ)


def set_commit_overlap(on: bool | None) -> bool:
    """Override ``VLLM_TFM_COMMIT_OVERLAP`` in this process (None: back to the environment's); the setting now
    in force, read by every commit from then on. For a same-engine A/B through ``collective_rpc``."""
    return _SWITCH.set(on)


class CommitOverlap:
    """The commit stream of one process's devices and the one commit queued on it but not joined yet."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._done: torch.cuda.Event | None = None
        self._device: torch.device | None = None
        self._held: tuple[Any, ...] = ()

    @property
    def pending(self) -> bool:
        """A commit was queued on the commit stream and no join has followed it yet."""
        return self._done is not None

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The commit stream of ``device`` (made on first use; the current stream's priority)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    @contextmanager
    def side(self, device: torch.device | str | None, *held: Any) -> Iterator[bool]:
        """Run the body on the commit stream after everything queued on the current stream so far, when the
        switch is on and ``device`` is a CUDA device (yields True); else on the current stream (yields
        False). ``held``: what the body reads that the current stream made, kept referenced until the join."""
        device = None if device is None else torch.device(device)
        if device is None or device.type != "cuda" or not commit_overlap_enabled():
            yield False
            return
        self.join()  # a commit not joined yet (a step without drafting or sampling): it comes first
        stream = self.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                yield True
        finally:
            done = torch.cuda.Event()
            done.record(stream)
            self._done, self._device, self._held = done, device, held

    def join(self) -> bool:
        """Make the current stream wait for the queued commit (no host wait); False when none was pending."""
        done, device = self._done, self._device
        if done is None:
            return False
        torch.cuda.current_stream(device).wait_event(done)
        self._done, self._device, self._held = None, None, ()
        return True


OVERLAP = CommitOverlap()
"""The process's commit overlap (one tfm model runner per worker process)."""

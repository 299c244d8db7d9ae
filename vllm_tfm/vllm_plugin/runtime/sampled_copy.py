"""A step's sampled tokens copied to pinned host memory as soon as they are final (deferred drafts,
``deferred_drafts.py``): vLLM's bookkeeping then waits for this copy instead of the whole GPU queue."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["SampledCopy"]


class SampledCopy:
    """The sampled tokens of a step, copied to pinned memory as soon as they are final."""

    def __init__(self) -> None:
        self._host: Tensor | None = None
        self._src: Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._view: Tensor | None = None

    def record(self, sampled: Tensor) -> None:
        """Queue the copy of ``sampled`` behind the work queued so far (a CUDA tensor: pinned buffer and
        an event, no wait; a CPU tensor: a plain copy)."""
        self._src = sampled
        if not sampled.is_cuda:
            self._view = sampled.clone()
            return
        numel = sampled.numel()
        if self._host is None or self._host.numel() < numel or self._host.dtype != sampled.dtype:
            self._host = torch.empty(max(numel, 1024), dtype=sampled.dtype, pin_memory=True)
        self._view = self._host[:numel].view(sampled.shape)
        self._view.copy_(sampled, non_blocking=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()

    def holds(self, sampled: Any) -> bool:
        """Whether the pending record is of ``sampled`` (the same tensor object)."""
        return self._src is not None and self._src is sampled

    def host_for(self, sampled: Any) -> Tensor | None:
        """The host copy of ``sampled`` once complete (waits for the copy only), or None when the
        last recorded tensor is not ``sampled``. Consumes the record."""
        if self._src is None or self._src is not sampled:
            return None
        if self._src.is_cuda:
            assert self._event is not None
            self._event.synchronize()
        self._src = None
        return self._view

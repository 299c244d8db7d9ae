"""Many small host arrays to the device in one copy.

Each ``torch.from_numpy(a).to(device)`` is a host-to-device copy of its own (from pageable
memory: staged, and ordered after the work already queued on the stream). A decode step needs
a dozen small index arrays; :func:`packed_upload` puts them into one pinned buffer (when the
device is a GPU), copies it with one non-blocking transfer and returns views of the device copy.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

__all__ = ["packed_upload"]


def packed_upload(arrays: Mapping[str, np.ndarray], device: torch.device | str) -> dict[str, Tensor]:
    """int64 device tensors (views of one buffer, same shapes) of the given host arrays.

    The views share one allocation: treat them as read-only. On a GPU the copy is asynchronous
    from pinned memory (the pinned block is kept until the copy has run by PyTorch's host
    allocator), so the host does not wait for the stream.
    """
    device = torch.device(device)
    items = [(name, np.ascontiguousarray(a, dtype=np.int64)) for name, a in arrays.items()]
    sizes = [a.size for _, a in items]
    flat = np.concatenate([a.reshape(-1) for _, a in items]) if items else np.zeros(0, dtype=np.int64)
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    return {name: t if a.ndim == 1 else t.view(a.shape) for (name, a), t in zip(items, dev.split(sizes))}

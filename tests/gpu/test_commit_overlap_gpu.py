"""GPU test: the commit stream of ``runtime/commit_overlap.py`` is another stream that starts after what the
current stream queued before the fork, and the join makes the current stream wait for what was queued on it,
without a host wait. Long sleeps on the GPU make each order the one a missing wait would break.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_commit_overlap_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_tfm.vllm_plugin.runtime.commit_overlap import CommitOverlap, set_commit_overlap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H100's / H200's clocks: far longer than the host takes to queue the rest


def test_the_commit_stream_follows_the_fork_and_the_join_orders_the_current_stream_after_it():
    dev = torch.device("cuda", torch.cuda.current_device())
    set_commit_overlap(True)
    try:
        overlap = CommitOverlap()
        main = torch.cuda.current_stream(dev)
        x = torch.zeros(1 << 20, device=dev)
        y = torch.zeros_like(x)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # on the current stream, before the fork
        x.fill_(1.0)
        held = torch.ones(3, device=dev)
        with overlap.side(dev, held) as side:
            assert side is True
            assert torch.cuda.current_stream(dev) != main
            y.copy_(x)  # runs after the sleep and the fill: the fork waited for them
            torch.cuda._sleep(SLEEP_CYCLES)
            x.fill_(2.0)  # late on the commit stream
        assert torch.cuda.current_stream(dev) == main and overlap.pending
        assert overlap._held == (held,)  # kept until the join
        assert overlap.join() is True and not overlap.pending and overlap._held == ()
        z = x.clone()  # queued after the join: sees the commit stream's last write
        assert float(y.min()) == 1.0 and float(z.min()) == 2.0
        assert overlap.join() is False  # nothing pending
    finally:
        set_commit_overlap(None)


def test_a_fork_joins_a_commit_left_pending_first():
    dev = torch.device("cuda", torch.cuda.current_device())
    set_commit_overlap(True)
    try:
        overlap = CommitOverlap()
        x = torch.zeros(1 << 20, device=dev)
        with overlap.side(dev):
            torch.cuda._sleep(SLEEP_CYCLES)
            x.fill_(3.0)
        with overlap.side(dev):  # no join in between: the first commit is ordered before this one
            y = x.clone()
        overlap.join()
        assert float(y.min()) == 3.0
    finally:
        set_commit_overlap(None)

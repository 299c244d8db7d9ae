"""The benchmark switches on CUDA (skipped without a device): acceptance replay gives the same
result on the GPU as on the CPU for the same uniforms, and the stage timer's CUDA events measure
device time (a sleep kernel of known length) without making the host wait for the device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _trees import random_tree_parents  # noqa: E402

from vllm_tfm.tree.types import Tree, TreeBatch  # noqa: E402
from vllm_tfm.verify.acceptance_replay import pmf_cdf, replay_accept, spine_first_logits  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.stage_timing import StageTimer  # noqa: E402


def test_replay_on_cuda_equals_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 64
    trees = TreeBatch.from_trees([
        Tree.from_parents(torch.randint(0, vocab, (17,), generator=gen), random_tree_parents(17, gen, kind))
        for kind in ("random", "deep", "chain", "star")
    ])
    logits = torch.randn(trees.num_nodes, vocab, generator=gen)
    u = torch.rand(4, generator=gen, dtype=torch.float64)
    cdf = pmf_cdf([0.1, 0.2, 0.3, 0.1, 0.1, 0.1, 0.1])
    cpu = replay_accept(trees, logits, u, cdf)
    gpu = replay_accept(trees.to("cuda"), logits.cuda(), u.cuda(), cdf.cuda())
    for a, b in ((cpu.result.output_tokens, gpu.result.output_tokens), (cpu.drawn, gpu.drawn), (cpu.clamped, gpu.clamped)):
        assert torch.equal(a, b.cpu())
    shaped = spine_first_logits(torch.randn(2, 15, 248_320, device="cuda", dtype=torch.bfloat16))
    assert shaped.dtype == torch.bfloat16 and shaped.softmax(-1).max(-1).values.float().mean().item() == pytest.approx(0.9, abs=0.01)


def test_stage_timer_events_measure_device_time() -> None:
    timer = StageTimer(enabled=True, use_cuda=True)
    torch.cuda._sleep(1000)  # warm the kernel
    torch.cuda.synchronize()
    with timer.span("target_forward"):
        torch.cuda._sleep(40_000_000)  # 40M cycles: 20 ms at 2 GHz, 40 ms at 1 GHz
    got = timer.collect()
    ms = got["stages"]["target_forward"]["total_ms"]
    assert got["clock"] == "cuda_events" and 15.0 < ms < 200.0


def test_stage_timer_drain_does_not_wait_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every DRAIN_EVERY spans the timer folds in only the events the device has reached: spans
    queued behind a long kernel stay pending and the host does not wait; collect() resolves them."""
    import time

    from vllm_tfm.vllm_plugin.runtime import stage_timing

    monkeypatch.setattr(stage_timing, "DRAIN_EVERY", 8)
    timer = StageTimer(enabled=True, use_cuda=True)
    timer.note_batch(1, 1)
    for _ in range(8):
        with timer.span("gdn_tree"):
            torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    timer._drain(wait=False)
    assert timer._pending == [] and len(timer._ms["gdn_tree"]) == 8  # all reached: all resolved
    torch.cuda._sleep(200_000_000)  # 100-200 ms of device time ahead of the next spans
    t0 = time.perf_counter()
    for _ in range(8):  # the 8th close drains: nothing reached yet
        with timer.span("gdn_tree"):
            torch.cuda._sleep(1000)
    host_s = time.perf_counter() - t0
    assert len(timer._pending) == 8 and host_s < 0.05
    got = timer.collect()
    assert got["stages"]["gdn_tree"]["count"] == 16 and got["stages"]["gdn_tree"]["per_step_sum"]["count"] == 1

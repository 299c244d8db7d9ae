"""The full-graph step topology kernel (``cuda/tree_step_topology.cu``) on the GPU against its reference
(the host functions): the GDN plan buffer, the attention bitmasks and the depth positions equal entry
for entry on fresh random trees, chains, stars and deep trees, with and without a row map, at the
runtime's sizes (B + 1 = 17, 33, 65 nodes; up to 32 requests) and at the kernel's limits; malformed
trees are counted. Also a CUDA-event timing of the launch (printed, not asserted)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from vllm_tfm.kernels import step_topology as kst  # noqa: E402
from vllm_tfm.kernels.loader import kernels_available  # noqa: E402
from vllm_tfm.kernels.plan import TreePlan  # noqa: E402

DEV = torch.device("cuda")


def _trees(g: np.random.Generator, rows: int, n: int) -> np.ndarray:
    out = []
    for i in range(rows):
        kind = ("random", "chain", "star", "deep")[i % 4]
        if kind == "chain":
            p = np.arange(-1, n - 1)
        elif kind == "star":
            p = np.array([-1] + [0] * (n - 1))
        elif kind == "deep":
            p = np.arange(-1, n - 1)
            p[5::9] = np.maximum(p[5::9] - 3, 0)
        else:
            p = np.array([-1] + [int(g.integers(0, k)) for k in range(1, n)])
        out.append(p)
    return np.stack(out).astype(np.int64)


def _buffers(r: int, n: int):
    plan = torch.full((TreePlan.fixed_size(r, n) + 3,), -7, dtype=torch.int32, device=DEV)
    bits = torch.full((r * n, (n + 63) // 64), -7, dtype=torch.int64, device=DEV)
    pos = (torch.arange(r * n, dtype=torch.int64, device=DEV) * 3 + 11)
    return plan, bits, pos, torch.zeros(1, dtype=torch.int32, device=DEV)


@pytest.mark.skipif(not kernels_available(), reason="NVRTC kernels unavailable")
@pytest.mark.parametrize("r, n, mapped", [(1, 17, False), (8, 17, True), (32, 17, False), (1, 33, False),
                                          (8, 33, True), (2, 65, False), (16, 65, True), (3, 128, True), (1, 2, False)])
def test_the_kernel_writes_the_host_tables(r: int, n: int, mapped: bool) -> None:
    g = np.random.default_rng(17 * r + n)
    pool = r + 5 if mapped else r
    parents = torch.from_numpy(_trees(g, pool, n)).to(DEV)
    rows = torch.from_numpy(g.permutation(pool)[:r].astype(np.int32)).to(DEV) if mapped else None
    got, want = _buffers(r, n), _buffers(r, n)
    assert kst.unsupported_reason(parents, rows, n, *got) is None
    kst.step_topology(parents, rows, n, *got)
    kst.step_topology_reference(parents, rows, n, *want)
    torch.cuda.synchronize()
    for name, a, b in zip(("plan", "bits", "positions"), got[:3], want[:3]):
        assert torch.equal(a, b), f"{name}: {torch.nonzero(a != b)[:5].tolist()}"
    assert int(got[3].item()) == 0


@pytest.mark.skipif(not kernels_available(), reason="NVRTC kernels unavailable")
@pytest.mark.parametrize("r, n", [(1, 17), (8, 33), (3, 128)])
def test_mrope_positions_in_every_row(r: int, n: int) -> None:
    """M-RoPE's [3, tokens] positions (a strided view of a wider buffer, as vLLM's ``mrope_positions.gpu``):
    each row as the reference writes it, past the step untouched."""
    g = np.random.default_rng(5 * r + n)
    parents = torch.from_numpy(_trees(g, r, n)).to(DEV)
    width = r * n + 8
    fresh = torch.stack([torch.arange(width, dtype=torch.int64, device=DEV) * (q + 1) + 50 * q for q in range(3)])
    got_pos, want_pos = fresh.clone(), fresh.clone()
    got, want = _buffers(r, n), _buffers(r, n)
    assert kst.unsupported_reason(parents, None, n, got[0], got[1], got_pos[:, : r * n], got[3]) is None
    kst.step_topology(parents, None, n, got[0], got[1], got_pos[:, : r * n], got[3])
    kst.step_topology_reference(parents, None, n, want[0], want[1], want_pos[:, : r * n], want[3])
    torch.cuda.synchronize()
    assert torch.equal(got_pos, want_pos), f"{torch.nonzero(got_pos != want_pos)[:5].tolist()}"
    assert torch.equal(got_pos[:, r * n:], fresh[:, r * n:])
    assert not torch.equal(got_pos[2], fresh[2])  # the last row was written too
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(not kernels_available(), reason="NVRTC kernels unavailable")
def test_malformed_trees_are_counted() -> None:
    n = 17
    par = np.tile(np.arange(-1, n - 1), (3, 1)).astype(np.int64)
    par[1, 7] = 9  # after its child
    par[2, 0] = 0  # a root that is not -1
    parents = torch.from_numpy(par).to(DEV)
    buf = _buffers(3, n)
    kst.step_topology(parents, None, n, *buf)
    assert int(buf[3].item()) == 2


@pytest.mark.skipif(not kernels_available(), reason="NVRTC kernels unavailable")
def test_launch_time_is_printed() -> None:
    for r, n in ((1, 17), (8, 17), (8, 33)):
        parents = torch.from_numpy(_trees(np.random.default_rng(0), r, n)).to(DEV)
        buf = _buffers(r, n)
        for _ in range(5):
            kst.step_topology(parents, None, n, *buf)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            kst.step_topology(parents, None, n, *buf)
        end.record()
        torch.cuda.synchronize()
        print(f"tree_step_topology R={r} n={n}: {1000 * start.elapsed_time(end) / 50:.2f} us per launch (eager)")

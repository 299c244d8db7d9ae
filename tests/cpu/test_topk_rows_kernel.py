"""The one-launch top-K of the DFlash candidates (``cuda/topk_rows.cu``, ``vllm_tfm.kernels.topk_rows``) on
the CPU: the torch reference against an independent sort in Python; the kernel through the CUDA emulation
(cuda/host_emu) against the reference, value and index for index, on fresh random rows of every dtype, with
heavy ties, -inf, NaN, -0.0, k = 1 and k = V, lengths that are not multiples of 8, strided and misaligned
rows and every cluster size; the launch plan at the Qwen3.6-27B shape; the refusals; the dispatch and its
switch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _emulation import emulated, emulation_build_dir

from vllm_tfm.kernels import topk_rows as ktk
from vllm_tfm.tree.padded import stable_topk

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_topk_rows")


def _python_topk(row: list[float], k: int) -> list[int]:
    """Indices of the k best entries: NaN first, then larger values (-0.0 == 0.0), ties to the lower index."""
    def rank(i: int) -> tuple[int, float, int]:
        v = row[i]
        return (0, 0.0, i) if math.isnan(v) else (1, -v, i)

    return sorted(range(len(row)), key=rank)[:k]


def _rows(gen: torch.Generator, rows: int, v: int, dtype: torch.dtype, levels: int | None = None) -> torch.Tensor:
    """Random logits; ``levels``: only that many distinct values (heavy ties)."""
    x = torch.randn(rows, v, generator=gen) * 4
    if levels is not None:
        x = torch.randint(0, levels, (rows, v), generator=gen).float() - levels / 2
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_orders_as_an_independent_sort(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = _rows(gen, 3, 300, dtype, levels=9)
    x[0, 5], x[0, 200], x[1, 7], x[1, 8] = float("nan"), float("nan"), -0.0, 0.0
    x[2, :50] = float("-inf")
    for k in (1, 17, 300):
        vals, idx = ktk.topk_rows_reference(x, k)
        for r in range(3):
            assert idx[r].tolist() == _python_topk(x[r].float().tolist(), k)
        assert vals.dtype == torch.float32 and torch.equal(vals.nan_to_num(7.0), x.gather(1, idx).float().nan_to_num(7.0))
    clean = _rows(gen, 4, 3000, dtype, levels=40)  # NaN-free: stable_topk's order
    assert torch.equal(ktk.topk_rows_reference(clean, 100)[1], stable_topk(clean, 100)[1])


def _check(emu_dir: Path, x: torch.Tensor, k: int, cluster: int | None = None) -> list[int]:
    """The kernel against the reference; returns the launches' cluster sizes."""
    want_v, want_i = ktk.topk_rows_reference(x, k)
    with emulated(emu_dir) as launches:
        got_v, got_i = ktk.topk_rows(x, k, cluster=cluster)
        clusters = list(launches.clusters)
    assert torch.equal(got_i, want_i), f"indices differ at {(got_i != want_i).nonzero()[:5].tolist()}"
    assert torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0)) and torch.equal(got_v.isnan(), want_v.isnan())
    assert got_v.dtype == torch.float32 and got_i.dtype == torch.int64
    return clusters


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_kernel_equals_the_reference_on_random_rows_with_ties(emu_dir, dtype, cluster) -> None:
    gen = torch.Generator().manual_seed(10 * cluster + DTYPES.index(dtype))
    x = _rows(gen, 2, 2051, dtype)  # not a multiple of 8: the last CTA's chunk is short
    x[1] = _rows(gen, 1, 2051, dtype, levels=5)[0]  # ~400 copies of each value: the k-th ties with hundreds
    assert _check(emu_dir, x, 300, cluster) == [cluster]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_edge_rows(emu_dir, dtype) -> None:
    gen = torch.Generator().manual_seed(77 + DTYPES.index(dtype))
    x = _rows(gen, 4, 1024, dtype)
    x[0] = 1.5  # all equal: the first k indices
    x[1, ::3] = float("-inf")
    x[1, 1000:] = float("-inf")
    x[2, [3, 500, 1023]] = float("nan")  # NaN first, by index
    x[3, :512] = -0.0  # ties with 0.0
    x[3, 512:] = 0.0
    for k in (1, 64, 1024):  # k = V: the whole row sorted
        _check(emu_dir, x, k, cluster=4)


def test_kernel_strided_misaligned_and_3d_rows(emu_dir) -> None:
    gen = torch.Generator().manual_seed(5)
    big = _rows(gen, 3, 1500, torch.bfloat16, levels=30)
    x = big[:, 3:1400]  # rows 1500 apart, each starting 6 bytes past 16-byte alignment: scalar loads
    assert x.stride() == (1500, 1)
    _check(emu_dir, x, 200, cluster=2)
    cube = _rows(gen, 6, 777, torch.float16).reshape(2, 3, 777)  # [R, D, V] as the Weaver build passes them
    want_v, want_i = ktk.topk_rows_reference(cube, 33)
    with emulated(emu_dir):
        got_v, got_i = ktk.topk_rows(cube, 33)
    assert got_i.shape == (2, 3, 33) and torch.equal(got_i, want_i) and torch.equal(got_v, want_v)


def test_launch_plan_at_the_27b_shape_and_its_refusals() -> None:
    mib = 227 * 1024
    for rows in (15, 120):  # batch 1 and 8, D = 15 depths
        c, chunk, smem = ktk.launch_plan(rows, 248320, 512, 2, 132, mib)
        assert c == 8 and chunk == 31040 and smem <= ktk.SMEM_TARGET  # two CTAs per SM
        assert smem == ktk.topk_smem_bytes(31040, 8, 512, 2)
    assert ktk.launch_plan(15, 248320, 512, 4, 132, mib)[0] == 8  # float32 rows: 124 KB chunks, still one cluster
    assert ktk.launch_plan(200, 2000, 64, 2, 132, mib)[0] == 1  # enough rows and a small row: no cluster
    assert "1 <= k <= min(V, 1024)" in ktk.launch_plan(1, 248320, 2048, 2, 132, mib)
    assert "1 <= k <= min(V, 1024)" in ktk.launch_plan(1, 100, 101, 2, 132, mib)
    assert "needs" in ktk.launch_plan(1, 4_000_000, 512, 2, 132, mib)  # 1 MB chunks at a cluster of 8
    with pytest.raises(ValueError, match="cluster must be 1, 2, 4 or 8, got 3"):
        ktk.launch_plan(1, 1000, 8, 2, 132, mib, cluster=3)
    with pytest.raises(ValueError, match="topk_rows: the logits are torch.float64"):
        ktk.topk_rows(torch.zeros(2, 100, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="topk_rows: the logits' last dimension is not contiguous"):
        ktk.topk_rows(torch.zeros(100, 2, dtype=torch.bfloat16).t(), 4)


def test_candidates_dispatch_and_switch(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _rows(gen, 5, 600, torch.bfloat16)
    want = torch.topk(x.float(), 40, dim=-1)
    got = ktk.topk_candidates(x, 40)  # CPU tensors: torch.topk (NOT_CUDA, no warning)
    assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
    assert ktk.topk_rows_unsupported_reason(x, 40) == ktk.NOT_CUDA
    assert ktk.topk_candidates(x, 10_000)[1].shape == (5, 600)  # k clipped to V
    x64 = x.double()
    assert ktk.topk_candidates(x64, 3)[0].dtype == torch.float64


def test_candidates_take_the_kernel_where_it_runs(emu_dir, monkeypatch) -> None:
    """With the device checks passed (as on a GPU), the dispatcher launches the kernel and its order."""
    gen = torch.Generator().manual_seed(2)
    x = _rows(gen, 3, 900, torch.bfloat16, levels=20)
    plan = ktk._checked_plan
    monkeypatch.setattr(ktk, "_checked_plan", lambda x, k, need_cuda, **kw: plan(x, k, need_cuda=False, **kw))
    with emulated(emu_dir) as launches:
        vals, idx = ktk.topk_candidates(x, 50)
        assert len(launches) == 1
        ktk.topk_candidates(x, 50, kernel=False)  # torch.topk, no launch
        assert len(launches) == 1
    want_v, want_i = ktk.topk_rows_reference(x, 50)
    assert torch.equal(idx, want_i) and torch.equal(vals, want_v)


"""The full-graph step topology kernel (``cuda/tree_step_topology.cu``) on the CPU through the CUDA
emulation, against its reference (the host functions the runtime used: ``TreePlan.build_into``, the
ancestor bitmasks, the depth positions): every entry of the GDN plan buffer, the attention bitmasks
and the positions equal, on random, chain, star and deep trees, one and several requests, with and
without a row map, with 1-d positions and with M-RoPE's three rows; malformed trees are counted, not walked
forever."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _emulation import emulated, emulation_build_dir

from vllm_tfm.kernels import step_topology as kst
from vllm_tfm.kernels.plan import TreePlan

SENTINEL = -7


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_step_topology")


def _tree(kind: str, n: int, g: np.random.Generator) -> np.ndarray:
    if kind == "chain":
        return np.arange(-1, n - 1, dtype=np.int64)
    if kind == "star":
        return np.array([-1] + [0] * (n - 1), dtype=np.int64)
    if kind == "deep":  # a long spine with a few side branches
        par = np.arange(-1, n - 1, dtype=np.int64)
        par[3::7] = np.maximum(par[3::7] - 2, 0)
        return par
    return np.array([-1] + [int(g.integers(0, k)) for k in range(1, n)], dtype=np.int64)


def _buffers(r: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = torch.full((TreePlan.fixed_size(r, n) + 5,), SENTINEL, dtype=torch.int32)
    bits = torch.full((r * n, (n + 63) // 64), SENTINEL, dtype=torch.int64)
    positions = (torch.arange(r * n, dtype=torch.int64) + 1000 * torch.arange(r).repeat_interleave(n) + 7)
    return plan, bits, positions, torch.zeros(1, dtype=torch.int32)


def _run(fn, parents: torch.Tensor, rows: torch.Tensor | None, n: int, r: int):
    plan, bits, positions, err = _buffers(r, n)
    fn(parents, rows, n, plan, bits, positions, err)
    return plan, bits, positions, err


CASES = [
    (1, 17, ["random"], False),
    (1, 2, ["chain"], False),
    (3, 17, ["chain", "star", "random"], True),
    (8, 17, ["random"] * 8, True),
    (2, 33, ["deep", "random"], False),
    (2, 65, ["deep", "star"], True),
    (1, 100, ["random"], False),
    (4, 128, ["chain", "random", "deep", "star"], True),
]


@pytest.mark.parametrize("r, n, kinds, mapped", CASES)
def test_the_kernel_writes_the_host_tables_entry_for_entry(emu_dir: Path, r: int, n: int, kinds: list[str],
                                                           mapped: bool) -> None:
    g = np.random.default_rng(r * 1000 + n)
    pool = r + 3 if mapped else r  # proposal rows; a row map picks R of them in another order
    trees = [_tree(kinds[i % len(kinds)], n, g) for i in range(pool)]
    width = n + (2 if mapped else 0)  # rows longer than n (the kernel reads the first n entries)
    parents = torch.full((pool, width), 99, dtype=torch.int64)
    parents[:, :n] = torch.from_numpy(np.stack(trees))
    rows = torch.from_numpy(g.permutation(pool)[:r].astype(np.int32)) if mapped else None
    want = _run(kst.step_topology_reference, parents, rows, n, r)
    with emulated(emu_dir) as launches:
        got = _run(kst.step_topology, parents, rows, n, r)
    assert [name for name, *_ in launches] == ["tree_step_topology"]
    for name, a, b in zip(("plan", "bits", "positions"), got[:3], want[:3]):
        assert torch.equal(a, b), f"{name} differs at {torch.nonzero(a != b)[:5].tolist()}"
    assert int(got[3][0]) == 0
    # the tables are a plan: the host's own plan of the same trees reads back from the buffer
    assert int(got[0][TreePlan.fixed_size(r, n)]) == SENTINEL  # nothing written past the layout


@pytest.mark.parametrize("r, n, rows_of_positions", [(1, 17, 3), (3, 33, 3), (2, 128, 3), (4, 9, 1)])
def test_mrope_positions_get_root_plus_depth_in_every_row(emu_dir: Path, r: int, n: int,
                                                          rows_of_positions: int) -> None:
    """M-RoPE (vLLM's ``mrope_positions`` [3, tokens], a strided view of a wider buffer): every row's tree
    rows become that row's root + depth, the rows past the step's tokens untouched, as the 1-d reference
    does row by row."""
    g = np.random.default_rng(7 * r + n)
    parents = torch.from_numpy(np.stack([_tree(("random", "deep", "star", "chain")[i % 4], n, g)
                                         for i in range(r)]))
    width = r * n + 6
    base = torch.arange(width, dtype=torch.int64)
    buf = torch.stack([base * (q + 2) + 100 * q + 5 for q in range(rows_of_positions)])  # rows differ
    positions = buf[:, : r * n + 3]  # row stride `width`, longer than the step
    plan, bits, _, err = _buffers(r, n)
    with emulated(emu_dir) as launches:
        kst.step_topology(parents, None, n, plan, bits, positions, err)
    assert [name for name, *_ in launches] == ["tree_step_topology"]
    assert int(err[0]) == 0
    fresh = torch.stack([base * (q + 2) + 100 * q + 5 for q in range(rows_of_positions)])
    for q in range(rows_of_positions):  # the 1-d reference on each row alone
        row = fresh[q].clone()
        kst.step_topology_reference(parents, None, n, *_buffers(r, n)[:2], row, torch.zeros(1, dtype=torch.int32))
        assert torch.equal(buf[q], row), f"row {q} differs at {torch.nonzero(buf[q] != row)[:5].tolist()}"
    assert torch.equal(buf[:, r * n:], fresh[:, r * n:])  # past the step: untouched
    depth_of_node_1 = 1
    assert int(buf[0, 1]) == int(fresh[0, 0]) + depth_of_node_1  # every tree's node 1 is a child of its root
    ref = fresh[:, : r * n + 3].clone()
    kst.step_topology_reference(parents, None, n, *_buffers(r, n)[:2], ref, torch.zeros(1, dtype=torch.int32))
    assert torch.equal(ref, positions)  # the reference takes the [P, tokens] layout too


def test_malformed_trees_are_counted_and_the_reference_raises(emu_dir: Path) -> None:
    n = 9
    good = np.arange(-1, n - 1)
    bad = good.copy()
    bad[4] = 6  # a parent after its child
    bad[0] = 3  # a root that is not -1
    parents = torch.from_numpy(np.stack([good, bad])).to(torch.int64)
    with emulated(emu_dir):
        plan, bits, positions, err = _run(kst.step_topology, parents, None, n, 2)
    assert int(err[0]) == 2
    # the good tree's rows are still right; the bad tree's nodes that reach a malformed one keep depth 0
    want = _run(kst.step_topology_reference, parents[:1], None, n, 1)
    assert torch.equal(bits[:n], want[1])
    assert torch.equal(positions[:n], want[2][:n])
    with pytest.raises(ValueError, match="parent"):
        _run(kst.step_topology_reference, parents, None, n, 2)


def test_arguments_the_kernel_cannot_take_are_named() -> None:
    parents = torch.zeros(2, 17, dtype=torch.int64)
    plan, bits, positions, err = _buffers(2, 17)
    assert kst.unsupported_reason(parents, None, 17, plan, bits, positions, err) == kst.NOT_CUDA
    assert "nodes per tree" in kst.unsupported_reason(parents, None, 1, plan, bits, positions, err)
    assert "bits must be int64" in kst.unsupported_reason(parents, None, 17, plan, bits[:, :0], positions, err)
    big = torch.zeros(40 * 65, 2, dtype=torch.int64)
    assert "at most 2048" in kst.unsupported_reason(torch.zeros(40, 65, dtype=torch.int64), None, 65,
                                                     torch.zeros(TreePlan.fixed_size(40, 65), dtype=torch.int32),
                                                     big, None, err)
    assert "rows must be int32" in kst.unsupported_reason(parents, torch.zeros(2, dtype=torch.int64), 17, plan, bits,
                                                          positions, err)
    assert ">= " in kst.unsupported_reason(parents, None, 17, plan[:10], bits, positions, err)
    five_rows = torch.zeros(5, 34, dtype=torch.int64)
    assert "positions must be int64" in kst.unsupported_reason(parents, None, 17, plan, bits, five_rows, err)
    columns = torch.zeros(34, 3, dtype=torch.int64).t()  # [3, 34] whose rows are not contiguous
    assert "contiguous rows" in kst.unsupported_reason(parents, None, 17, plan, bits, columns, err)
    assert "positions must be int64" in kst.unsupported_reason(parents, None, 17, plan, bits, positions[:33], err)
    with pytest.raises(ValueError, match="step_topology: n = 1"):
        kst.step_topology(parents, None, 1, plan, bits, positions, err)

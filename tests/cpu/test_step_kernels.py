"""The per-step kernel tables of the runtime (runtime/step_kernels.py), on the CPU.

The tables are computed once per step on the device; here their values are compared with the
indices the library's per-call path builds from host lists (``CommitIndices.build``), written out
independently with Python loops.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _trees import random_tree_parents
from vllm_tfm.kernels.plan import TreePlan
from vllm_tfm.vllm_plugin.runtime.step_kernels import StepKernels, step_kernels

S = 6  # speculative slots per request


def _step(trees: list[torch.Tensor]) -> SimpleNamespace:
    cu = np.zeros(len(trees) + 1, dtype=np.int64)
    cu[1:] = np.cumsum([t.numel() for t in trees])
    return SimpleNamespace(spec_parents=torch.cat(trees).numpy(), spec_cu=cu)


def test_plan_is_the_library_plan_of_the_step_trees():
    g = torch.Generator().manual_seed(0)
    trees = [random_tree_parents(n, g, kind) for n, kind in ((7, "random"), (1, "chain"), (5, "deep"), (4, "star"))]
    step = _step(trees)
    tables = StepKernels(step, torch.device("cpu"))
    ref = TreePlan.build(torch.cat(trees), torch.from_numpy(step.spec_cu))
    for name in ("cu", "perm", "pos", "depth", "pair_off", "pair_j", "req_of"):
        assert torch.equal(getattr(tables.plan, name), getattr(ref, name)), name
    assert (tables.plan.max_nodes, tables.plan.max_depth) == (ref.max_nodes, ref.max_depth)


def test_group_slots_and_commit_indices_match_per_request_loops():
    g = torch.Generator().manual_seed(1)
    num_req = 5
    trees = [random_tree_parents(int(n), g) for n in torch.randint(1, S + 2, (num_req,), generator=g)]
    step = _step(trees)
    tables = StepKernels(step, torch.device("cpu"))
    state_indices = torch.randperm(100, generator=g)[: num_req * (1 + S)].view(num_req, 1 + S).to(torch.int32)
    num_acc_before = torch.randint(1, S + 2, (num_req,), generator=g).to(torch.int32)
    grp = tables.group(state_indices, num_acc_before)
    assert tables.group(state_indices, num_acc_before) is grp  # once per group
    assert tables.group_of(grp.slots) is grp and tables.group_of(grp.slots.clone()) is None
    other = tables.group(state_indices.clone(), num_acc_before)  # another KV-cache group's tensor
    assert other is not grp
    last = torch.tensor([int(torch.randint(0, t.numel(), (1,), generator=g)) for t in trees])
    p = torch.tensor([int(torch.randint(0, S + 1, (1,), generator=g)) for _ in trees])
    gdn_idx, conv_idx = tables.commit_indices(grp, last, p)
    assert tables.commit_indices(grp, last, p)[0] is gdn_idx
    for r in range(num_req):
        a = int(num_acc_before[r])
        assert int(grp.read_slot[r]) == int(state_indices[r, a - 1])
        assert int(grp.conv_slot[r]) == int(state_indices[r, 0]) and int(grp.start32[r]) == a - 1
        assert int(gdn_idx.accepted[r]) == int(last[r]) == int(conv_idx.accepted[r])
        assert int(gdn_idx.src[r]) == int(state_indices[r, a - 1])
        assert int(gdn_idx.dst[r]) == int(state_indices[r, int(p[r])])
        assert int(conv_idx.src[r]) == int(conv_idx.dst[r]) == int(state_indices[r, 0])
        assert int(conv_idx.src_start[r]) == a - 1 and int(conv_idx.dst_start[r]) == int(p[r])
        assert int(gdn_idx.src_start[r]) == 0 == int(gdn_idx.dst_start[r])
    for idx in (gdn_idx, conv_idx):
        assert idx.snapshot is None
        assert all(t.dtype == torch.int32 for t in (idx.accepted, idx.src, idx.dst, idx.src_start, idx.dst_start))
    # the library's per-call path builds the same GDN indices from host lists (no aliasing here)
    lib = type(gdn_idx).build(last.tolist(), gdn_idx.src.tolist(), gdn_idx.dst.tolist(), "cpu")
    assert torch.equal(lib.src, gdn_idx.src) and torch.equal(lib.dst, gdn_idx.dst) and lib.snapshot is None


def test_no_tables_without_the_kernels():
    """On a machine where the four operations are the torch references (CPU), the runtime gets
    None and keeps the per-call path, whatever the device."""
    step = _step([torch.tensor([-1, 0])])
    assert step_kernels(step, torch.device("cpu")) is None


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside it (each a device launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", str(func))
        if name != "__get__":  # attribute reads (shape, dtype, ...) launch nothing
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_one_slot_commit_indices_are_slot_column_zero_and_one_copy_per_step():
    """One GDN state slot per request (``one_slot=True``): the layers read slot [n, 0] and the commit writes it from
    conv column 0, so every group's indices are its slot column 0 and zeros, the values the general path computes
    from the one-slot offsets (``read_offsets``, ``commit_destinations``) on vLLM's 1 + S column table. Per
    replayed step the only device work is the accepted nodes' int32 copy, shared by the groups (the general path
    gathers and copies per group); with commit reuse the index tensors are the same objects every step (the
    uploaded commit tables point into them)."""
    from vllm_tfm.vllm_plugin.runtime.one_slot import commit_destinations, read_offsets
    from vllm_tfm.vllm_plugin.runtime.step_kernels import CommitReuse

    g = torch.Generator().manual_seed(3)
    trees = [random_tree_parents(n, g, kind) for n, kind in ((7, "random"), (1, "chain"), (5, "deep"), (4, "star"))]
    step = _step(trees)
    r = len(trees)
    captured = StepKernels(step, torch.device("cpu"), one_slot=True)
    slot_tables = [torch.randperm(200, generator=g)[: r * (1 + S)].view(r, 1 + S).to(torch.int32) for _ in range(3)]
    groups = [captured.group(t, read_offsets(t)) for t in slot_tables]  # 3 KV-cache groups
    reuse = CommitReuse()
    first = None
    for i in range(3):
        tables = StepKernels(step, torch.device("cpu"), plan=captured.plan,
                             groups={k: type(v)(**{**v.__dict__, "commit": None}) for k, v in captured.groups.items()},
                             commit_reuse=reuse, one_slot=True)
        last = torch.tensor([int(torch.randint(0, t.numel(), (1,), generator=g)) for t in trees])
        p = commit_destinations(torch.randint(0, S + 1, (r,), generator=g))
        with _TorchCalls() as calls:
            got = [tables.commit_indices(tables.group_of(grp.slots), last, p) for grp in groups]
        if i > 0:
            assert calls.names == ["copy_"], calls.names  # the accepted nodes, once for the three groups
        flat = [t for pair in got for ci in pair for t in (ci.accepted, ci.src, ci.dst, ci.src_start, ci.dst_start)]
        if first is None:
            first = flat
        assert all(a is b for a, b in zip(first, flat))  # filled in place: the uploaded rows stay valid
        general = StepKernels(step, torch.device("cpu"))  # one_slot False: the gathers on the same offsets
        for (gdn_idx, conv_idx), table in zip(got, slot_tables):
            assert gdn_idx.src is gdn_idx.dst and conv_idx.src is conv_idx.dst  # read and written in place
            want_gdn, want_conv = general.commit_indices(general.group(table, read_offsets(table)), last, p)
            for got_i, want_i in ((gdn_idx, want_gdn), (conv_idx, want_conv)):
                for f in ("accepted", "src", "dst", "src_start", "dst_start"):
                    assert torch.equal(getattr(got_i, f), getattr(want_i, f)), f
                assert got_i.snapshot is None and got_i.src.dtype == torch.int32
            for k in range(r):  # written out: slot [n, 0], offsets 0
                assert int(gdn_idx.src[k]) == int(table[k, 0]) == int(conv_idx.dst[k])
                assert int(conv_idx.src_start[k]) == int(conv_idx.dst_start[k]) == 0 == int(gdn_idx.dst_start[k])


def test_the_one_slot_commit_switch_puts_one_slot_tables_on_the_general_path(monkeypatch: pytest.MonkeyPatch):
    """``VLLM_TFM_ONE_SLOT_COMMIT=0`` (or ``set_one_slot_commit(False)``, the same-engine A/B's setter) makes a
    one-slot engine's tables take the general path (a gather and copies per group), with the same index values;
    the override wins over the environment until it is reset, and a bad value is refused with its message."""
    from vllm_tfm.vllm_plugin.runtime import set_one_slot_commit
    from vllm_tfm.vllm_plugin.runtime.one_slot import commit_destinations, read_offsets
    from vllm_tfm.vllm_plugin.runtime.step_kernels import ONE_SLOT_COMMIT_ENV

    g = torch.Generator().manual_seed(5)
    trees = [random_tree_parents(n, g, kind) for n, kind in ((6, "random"), (3, "chain"))]
    step = _step(trees)
    table = torch.randperm(100, generator=g)[: 2 * (1 + S)].view(2, 1 + S).to(torch.int32)
    last, p = torch.tensor([4, 2]), commit_destinations(torch.tensor([2, 1]))

    def indices(one_slot: bool) -> tuple[bool, list[str], tuple]:
        tables = StepKernels(step, torch.device("cpu"), one_slot=one_slot)
        grp = tables.group(table, read_offsets(table))
        with _TorchCalls() as calls:
            got = tables.commit_indices(grp, last, p)
        return tables.one_slot, calls.names, got

    monkeypatch.delenv(ONE_SLOT_COMMIT_ENV, raising=False)
    on, on_calls, on_idx = indices(True)
    assert on and "gather" not in on_calls
    monkeypatch.setenv(ONE_SLOT_COMMIT_ENV, "0")
    off, off_calls, off_idx = indices(True)
    assert not off and "gather" in off_calls
    for got_i, want_i in zip(on_idx, off_idx):
        for f in ("accepted", "src", "dst", "src_start", "dst_start"):
            assert torch.equal(getattr(got_i, f), getattr(want_i, f)), f
    try:
        assert set_one_slot_commit(on=True) is True
        assert indices(True)[0]  # the override wins over the environment's 0
        assert not indices(False)[0]  # and never makes a per-draft engine one-slot
        with pytest.raises(ValueError, match="set_one_slot_commit takes True, False or None, got 1"):
            set_one_slot_commit(on=1)  # type: ignore[arg-type]
    finally:
        assert set_one_slot_commit(on=None) is False  # back to the environment's 0

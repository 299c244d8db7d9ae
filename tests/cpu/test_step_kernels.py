"""The per-step kernel tables of the runtime (runtime/step_kernels.py), on the CPU.

The tables are computed once per step on the device; here their values are compared with the
indices the library's per-call path builds from host lists (``CommitIndices.build``), written out
independently with Python loops.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
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

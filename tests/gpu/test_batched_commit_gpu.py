"""GPU test: the batched commit (one launch per kernel kind for all GDN layers of a step,
``VLLM_TFM_BATCHED_COMMIT=1``) writes the same SSM states and conv windows as the per-layer commit
(two launches per layer), bit for bit, at the Qwen3.6-27B GDN shape (H 16, K 128, HV 48, V 128,
conv width 4, conv dim 10240; 3 KV-cache groups, buffers shared across groups as vLLM does): through
the runtime (``commit_gdn_layers``, switch off vs on) and through the library entry points.

Trees: a root alone (n = 1), chains, stars, deep and random trees of up to 33 nodes (B = 32) in
one batch, requests accepting 0 drafts, R = 1 and 8.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_batched_commit_gpu.py -q``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _trees import random_tree_parents

from vllm_tfm.kernels import batched_commit as kb
from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason
from vllm_tfm.vllm_plugin.runtime.commit import commit_gdn_layers
from vllm_tfm.vllm_plugin.runtime.settings import BATCHED_COMMIT_ENV
from vllm_tfm.vllm_plugin.runtime.state import GDNStash
from vllm_tfm.vllm_plugin.runtime.step_kernels import StepKernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = torch.device("cuda")
H, K, HV, V, W, B = 16, 128, 48, 128, 4, 32  # Qwen3.6-27B GDN layer, tree budget of the e2e runs
CONV_DIM = 2 * H * K + HV * V
GROUPS = 3


@pytest.fixture(scope="module", autouse=True)
def _kernels_must_work():
    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Random normal values made on the GPU (the states are gigabytes), then cast."""
    return (scale * torch.randn(shape, generator=gen, device=DEV)).to(dtype)


def _depth(tree: torch.Tensor, node: int) -> int:
    d = 0
    while tree[node] >= 0:
        node, d = int(tree[node]), d + 1
    return d


CASES = {
    # R = 8, every tree kind, two requests accepting 0 drafts, one its whole chain
    "mixed_r8": ([(1, "chain"), (B + 1, "chain"), (B + 1, "star"), (B + 1, "deep"), (B + 1, "random"), (20, "random"),
                  (5, "chain"), (17, "deep")], [0, B, 7, B - 3, 30, 0, 4, 16]),
    "deep_r1": ([(B + 1, "deep")], [B]),
    "root_only_r1": ([(1, "chain")], [0]),
    "star_r1_no_drafts": ([(B + 1, "star")], [0]),
}


class Step:
    """One step's trees, 3 groups of ``per_group`` GDN layers (stashes), random operands."""

    def __init__(self, case: str, per_group: int, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        gd = torch.Generator(device=DEV).manual_seed(seed)
        shapes, last = CASES[case]
        trees = [random_tree_parents(n, g, kind) for n, kind in shapes]
        r = len(trees)
        cu = np.zeros(r + 1, dtype=np.int64)
        cu[1:] = np.cumsum([t.numel() for t in trees])
        t_nodes = int(cu[-1])
        self.parents, self.cu = torch.cat(trees).to(DEV), torch.from_numpy(cu).to(DEV)
        self.last = torch.tensor(last, device=DEV)
        self.num_acc = torch.tensor([_depth(tr, a) for tr, a in zip(trees, last)], device=DEV)
        self.tables = StepKernels(SimpleNamespace(spec_parents=torch.cat(trees).numpy(), spec_cu=cu), DEV)
        slots = GROUPS * r * (1 + B) + 2
        perm = torch.randperm(slots, generator=g)[: GROUPS * r * (1 + B)].view(GROUPS, r, 1 + B).to(torch.int32)
        prev = torch.randint(1, B + 2, (r,), generator=g).to(torch.int32).to(DEV)
        groups = [self.tables.group(perm[i].to(DEV), prev) for i in range(GROUPS)]
        # one state buffer per layer position, shared by that layer of each group (vLLM's layout:
        # the groups' slots are different blocks); conv windows dim-first views of [slots, L, D]
        self.ssm0 = [_randn(gd, slots, HV, V, K) for _ in range(per_group)]
        self.conv0 = [_randn(gd, slots, W - 1 + B, CONV_DIM, dtype=dtype) for _ in range(per_group)]
        self.stashes = []
        for grp in groups:
            for li in range(per_group):
                self.stashes.append((li, GDNStash(
                    x=_randn(gd, t_nodes, CONV_DIM, dtype=dtype), k=_randn(gd, t_nodes, H, K, dtype=dtype),
                    g=-0.5 * torch.rand(t_nodes, HV, generator=gd, device=DEV),
                    delta=_randn(gd, t_nodes, HV, V, scale=0.3),
                    state_indices=grp.slots, prev_accepted=grp.prev_accepted,
                    conv_state=None, ssm_state=None, width=W,  # type: ignore[arg-type]
                )))

    def fresh(self) -> tuple[list[GDNStash], list[torch.Tensor], list[torch.Tensor]]:
        ssm = [s.clone() for s in self.ssm0]
        conv = [c.clone() for c in self.conv0]
        stashes = [dataclasses.replace(s, ssm_state=ssm[li], conv_state=conv[li].transpose(-1, -2))
                   for li, s in self.stashes]
        return stashes, ssm, conv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("case", "per_group"), [("mixed_r8", 4), ("deep_r1", 16), ("root_only_r1", 16),
                                                 ("star_r1_no_drafts", 2)])
def test_batched_commit_equals_the_per_layer_commit_bit_for_bit(monkeypatch, case, per_group, dtype):
    step = Step(case, per_group, dtype, seed=sum(map(ord, case)))
    for s in (st for _, st in step.stashes):
        assert kgdn.commit_unsupported_reason(s.k, s.delta, step.ssm0[0]) is None
        assert kconv.conv_unsupported_reason(s.x, step.conv0[0].transpose(-1, -2), W) is None
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv(BATCHED_COMMIT_ENV, switch)
        stashes, ssm, conv = step.fresh()
        launches = commit_gdn_layers(stashes, step.parents, step.cu, step.last, step.num_acc, step.tables)
        torch.cuda.synchronize()
        assert launches == (None if switch == "0" else 2)
        results.append((ssm, conv))
    (ssm_a, conv_a), (ssm_b, conv_b) = results
    for li in range(per_group):
        assert torch.equal(ssm_a[li], ssm_b[li]), f"SSM states of layer position {li} differ"
        assert torch.equal(conv_a[li], conv_b[li]), f"conv windows of layer position {li} differ"
        assert not torch.equal(ssm_b[li], step.ssm0[li]) and not torch.equal(conv_b[li], step.conv0[li])


@pytest.mark.parametrize("case", ["mixed_r8", "deep_r1"])
def test_reused_commit_tables_write_the_per_layer_commits_states_over_replays(monkeypatch, case):
    """VLLM_TFM_COMMIT_REUSE: the same stashes and groups every "replay" (as a full graph gives them), the
    accepted nodes changing; the tables uploaded at the first replay, launched again, write the states of
    the per-layer commit bit for bit at every step."""
    from vllm_tfm.vllm_plugin.runtime.step_kernels import CommitReuse

    step = Step(case, 4, torch.bfloat16, seed=sum(map(ord, case)) + 1)
    r = step.last.shape[0]
    zeros = torch.zeros(r, dtype=step.last.dtype, device=step.last.device)
    accepted = [(step.last, step.num_acc), (zeros, zeros.to(step.num_acc.dtype)), (step.last, step.num_acc)]
    reuse = CommitReuse()
    (reused, ssm_r, conv_r), (per_layer, ssm_p, conv_p) = step.fresh(), step.fresh()

    def tables(with_reuse: CommitReuse | None) -> StepKernels:
        groups = {key: dataclasses.replace(g, commit=None) for key, g in step.tables.groups.items()}
        return StepKernels(step.tables.step, DEV, plan=step.tables.plan, groups=groups, commit_reuse=with_reuse)

    first = None
    for last, num_acc in accepted:
        monkeypatch.setenv(BATCHED_COMMIT_ENV, "1")
        assert commit_gdn_layers(reused, step.parents, step.cu, last, num_acc, tables(reuse)) == 2
        first = first or reuse.uploaded
        assert reuse.uploaded is first  # uploaded once
        monkeypatch.setenv(BATCHED_COMMIT_ENV, "0")
        assert commit_gdn_layers(per_layer, step.parents, step.cu, last, num_acc, tables(None)) is None
        torch.cuda.synchronize()
        for li in range(len(ssm_r)):
            assert torch.equal(ssm_r[li], ssm_p[li]) and torch.equal(conv_r[li], conv_p[li]), f"layer position {li}"


def test_library_batched_commits_equal_per_layer_kernel_calls():
    """``gdn_tree_commit_layers`` / ``tree_conv_commit_layers`` against ``gdn_tree_commit`` /
    ``tree_conv_commit`` per layer, with slots that alias across requests (snapshots)."""
    g = torch.Generator().manual_seed(5)
    gd = torch.Generator(device=DEV).manual_seed(5)
    shapes, last = CASES["mixed_r8"]
    trees = [random_tree_parents(n, g, kind) for n, kind in shapes]
    parents = torch.cat(trees).to(DEV)
    cu = torch.zeros(len(trees) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([t.numel() for t in trees]).cumsum(0)
    cu = cu.to(DEV)
    r, t_nodes, layers, slots = len(trees), parents.numel(), 3, 20
    acc = torch.tensor(last, device=DEV)
    ks = [_randn(gd, t_nodes, H, K, dtype=torch.bfloat16) for _ in range(layers)]
    gs = [-0.5 * torch.rand(t_nodes, HV, generator=gd, device=DEV) for _ in range(layers)]
    ds = [_randn(gd, t_nodes, HV, V, scale=0.3) for _ in range(layers)]
    xs = [_randn(gd, t_nodes, CONV_DIM, dtype=torch.bfloat16) for _ in range(layers)]
    perms = [torch.randperm(slots, generator=g) for _ in range(layers)]
    src = [p[:r].to(DEV) for p in perms]
    dst = [p[:r].roll(1).to(DEV) if i == 0 else p[r : 2 * r].to(DEV) for i, p in enumerate(perms)]  # layer 0 aliases
    s_start = [torch.randint(0, B, (r,), generator=g).to(DEV) for _ in range(layers)]
    d_start = [torch.randint(0, B, (r,), generator=g).to(DEV) for _ in range(layers)]
    ssm0 = [_randn(gd, slots, HV, V, K) for _ in range(layers)]
    conv0 = [_randn(gd, slots, CONV_DIM, W - 1 + B, dtype=torch.bfloat16) for _ in range(layers)]

    ssm_a, conv_a = [s.clone() for s in ssm0], [c.clone() for c in conv0]
    for i in range(layers):
        kgdn.gdn_tree_commit(ks[i], gs[i], ds[i], parents, cu, acc, ssm_a[i], src[i], dst[i])
        kconv.tree_conv_commit(xs[i], parents, cu, acc, conv_a[i], src[i], dst[i], W, s_start[i], d_start[i])
    ssm_b, conv_b = [s.clone() for s in ssm0], [c.clone() for c in conv0]
    kb.gdn_tree_commit_layers(ks, gs, ds, parents, cu, acc, ssm_b, src, dst)
    kb.tree_conv_commit_layers(xs, parents, cu, acc, conv_b, src, dst, W, s_start, d_start)
    torch.cuda.synchronize()
    for i in range(layers):
        assert torch.equal(ssm_a[i], ssm_b[i]) and torch.equal(conv_a[i], conv_b[i]), f"layer {i}"
        assert not torch.equal(ssm_b[i], ssm0[i])

"""The GDN tree kernels on fixed-layout plans (``TreePlan.build_into``, runtime/full_graphs.py): the same
results as on per-step plans, and launches recorded once in a CUDA graph compute other trees' results
when those trees are written into the plan's buffer before the replay."""

from __future__ import annotations

import pytest
import torch
from _kernel_marks import CAPTURES_A_GRAPH

from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.loader import device_smem_optin, kernels_available, kernels_unavailable_reason
from vllm_tfm.kernels.plan import CommitIndices, TreePlan

from test_kernels_gdn import DEV, FP32_TOL, chain, make_case, random_tree, reference, rel, star

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", autouse=True)
def _kernels_must_work():
    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")


def trees_of(kinds: str, n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    make = {"c": lambda: chain(n), "s": lambda: star(n), "r": lambda: random_tree(n, gen)}
    return [make[k]() for k in kinds]


def fixed_plan(parents: torch.Tensor, cu: torch.Tensor, n: int) -> TreePlan:
    buf = torch.zeros(TreePlan.fixed_size(cu.numel() - 1, n), dtype=torch.int32, device=DEV)
    return TreePlan.build_into(buf, parents, cu, n)


@pytest.mark.parametrize("variant", list(kgdn.VERIFY_VARIANTS))
@pytest.mark.parametrize(("kinds", "n"), [("rcsr", 33), ("r", 1), ("cs", 17), ("rrrrrrrr", 33)])
def test_verify_on_a_fixed_plan_equals_the_per_step_plan(variant: int, kinds: str, n: int) -> None:
    c = make_case(trees_of(kinds, n, seed=n), dtype=torch.bfloat16, seed=3)
    ref_plan = TreePlan.build(c["parents"], c["cu_nodes"], device=DEV)
    plan = fixed_plan(c["parents"], c["cu_nodes"], n)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"], c["state_indices"])
    o_ref, d_ref = kgdn.gdn_tree_verify_planned(ref_plan, *args, return_delta=True, block_v=32, variant=variant)
    o, d = kgdn.gdn_tree_verify_planned(plan, *args, return_delta=True, block_v=32, variant=variant)
    assert rel(d, d_ref) <= 1e-6 and rel(o.float(), o_ref.float()) <= 1e-6
    _, d64 = reference({k: (v.float() if v.is_floating_point() else v) for k, v in c.items()})
    assert rel(d, d64) <= FP32_TOL


@pytest.mark.parametrize(("kinds", "n"), [("rcsr", 33), ("rrrrrrrr", 33), ("rs", 65)])
def test_version_6_on_a_fixed_plan_with_the_drafters_depth_bound(kinds: str, n: int) -> None:
    # the runtime's full graphs give their plans the drafter's depth (15 at a DFlash block of 16) as depth_bound:
    # version 6 then takes its path solve there (kernels.gdn.grouped_solve), also over the chain (depth n - 1,
    # deeper than the bound: its long paths are solved in shared memory), within the bars of version 3 on the
    # per-step plan and of the float64 reference, and within float32 rounding of the level solve
    c = make_case(trees_of(kinds, n, seed=n + 1), h=2, hv=6, dtype=torch.bfloat16, seed=4)
    buf = torch.zeros(TreePlan.fixed_size(c["cu_nodes"].numel() - 1, n), dtype=torch.int32, device=DEV)
    plan = TreePlan.build_into(buf, c["parents"], c["cu_nodes"], n, depth_bound=15)
    assert kgdn.grouped_solve(plan, 128, 3, device_smem_optin(0)) == 1
    assert kgdn.grouped_solve(fixed_plan(c["parents"], c["cu_nodes"], n), 128, 3, device_smem_optin(0)) == 0
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"], c["state_indices"])
    launches, o, d = kgdn.verify_launches(plan, *args, return_delta=True, variant=6)
    assert [name for name, _ in launches] == ["gdn_tree_verify_grouped"]
    o.fill_(float("nan"))
    d.fill_(float("nan"))
    for _, fn in launches:
        fn()
    o3, d3 = kgdn.gdn_tree_verify_planned(TreePlan.build(c["parents"], c["cu_nodes"], device=DEV), *args,
                                          return_delta=True, variant=3)
    level_launches, _, d_levels = kgdn.verify_launches(plan, *args, return_delta=True, variant=6,
                                                       extra_options=("-DG6_SOLVE=0",))
    for _, fn in level_launches:
        fn()
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= 3e-3 and rel(d, d_ref) <= FP32_TOL, (rel(o, o_ref), rel(d, d_ref))
    assert rel(o.float(), o3.float()) <= 3e-3 and rel(d, d3) <= FP32_TOL
    assert rel(d, d_levels) <= 1e-6


def test_commit_on_a_fixed_plan_equals_the_per_step_plan() -> None:
    n = 33
    c = make_case(trees_of("rcs", n, seed=5), seed=6)
    ref_plan = TreePlan.build(c["parents"], c["cu_nodes"], device=DEV)
    plan = fixed_plan(c["parents"], c["cu_nodes"], n)
    _, delta = kgdn.gdn_tree_verify_planned(ref_plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                             c["state_indices"], return_delta=True)
    src = c["state_indices"].tolist()
    dst = [s + 100 for s in src]
    idx = CommitIndices.build([n - 1, 5, 0], src, dst, DEV)
    states = [torch.nn.functional.pad(c["ssm_state"], (0, 0, 0, 0, 0, 0, 0, 110)) for _ in range(2)]
    kgdn.gdn_tree_commit_planned(ref_plan, c["k"], c["g"], delta, idx, states[0])
    kgdn.gdn_tree_commit_planned(plan, c["k"], c["g"], delta, idx, states[1])
    assert torch.equal(states[0], states[1])


@CAPTURES_A_GRAPH
@pytest.mark.parametrize("variant", [3, 7])
def test_graph_replay_of_a_fixed_plan_computes_the_trees_written_last(variant: int) -> None:
    """Record conv + verify once (chains), then write other trees and inputs and replay: each replay ==
    the eager kernels on a per-step plan of those trees (verify versions 3 and 7)."""
    n, r, dim, width = 17, 3, 2 * 2 * 128 + 6 * 128, 4
    gen = torch.Generator().manual_seed(11)
    first = make_case(trees_of("ccc", n, 0), dtype=torch.bfloat16, seed=0)
    buf = torch.zeros(TreePlan.fixed_size(r, n), dtype=torch.int32, device=DEV)
    plan = TreePlan.build_into(buf, first["parents"], first["cu_nodes"], n)
    static = {k: v.clone() for k, v in first.items() if k not in ("parents", "cu_nodes")}
    x = torch.randn(r * n, dim, generator=gen).to(DEV, torch.bfloat16)
    conv_state = torch.randn(r + 2, dim, width - 1 + n, generator=gen).to(DEV, torch.bfloat16)
    weight = torch.randn(dim, width, generator=gen).to(DEV, torch.bfloat16)
    conv_slot = torch.tensor([2, 0, 4], dtype=torch.int32, device=DEV)
    start = torch.tensor([0, 3, 1], dtype=torch.int32, device=DEV)

    def step(p: TreePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = kconv.tree_causal_conv1d_planned(p, x, conv_state, conv_slot, weight, None, "silu", start)
        o, d = kgdn.gdn_tree_verify_planned(p, static["q"], static["k"], static["v"], static["g"], static["beta"],
                                            static["ssm_state"], static["state_indices"], return_delta=True, block_v=32,
                                            variant=variant)
        return y, o, d

    for _ in range(2):  # compile and warm up outside the capture
        step(plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(plan)
    for seed, kinds in ((1, "rsc"), (2, "rrr"), (3, "scr")):
        case = make_case(trees_of(kinds, n, seed), dtype=torch.bfloat16, seed=seed)
        for k, v in static.items():
            v.copy_(case[k])
        x.copy_(torch.randn(r * n, dim, generator=gen).to(DEV, torch.bfloat16))
        TreePlan.build_into(buf, case["parents"], case["cu_nodes"], n)
        graph.replay()
        want = step(TreePlan.build(case["parents"], case["cu_nodes"], device=DEV))
        torch.cuda.synchronize()
        assert torch.equal(outs[0], want[0]), kinds  # the conv: the same gathers and sums
        assert rel(outs[2], want[2]) <= 1e-6 and rel(outs[1].float(), want[1].float()) <= 1e-6, kinds

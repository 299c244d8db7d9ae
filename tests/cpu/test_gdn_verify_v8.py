"""Verify kernel version 8 (cuda/gdn_tree_verify_paths.cu: trees of up to 128 nodes whose paths have at most 17
nodes, a CTA of 16 warps per request, value head and 32 or 64 V columns, each node's rows of (I + X)^-1 and
Y (I + X)^-1 by back substitution over its path in registers) through the CPU emulation, against the float64
reference ``vllm_tfm.verify.gdn.gdn_tree_verify``.

Bars as for versions 6 and 7: o <= 3e-3 relative (rounded to bf16), delta <= 1e-5 with the three-part split of S0
(float32-accurate projections); every NaN-poisoned output element written; the state untouched. Trees: 128 nodes
of depth 16 (the bound), chains of 17 nodes, stars, a single node, node order unlike level order, several requests
of different sizes in one call, the full CUDA graphs' fixed-layout plans; the calls it refuses run version 6.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.plan import TreePlan

from _emulation import emulated, emulation_build_dir  # tests/cpu helper modules
from _gdn_emu_cases import _bounded_tree, _case, _depth_first, _g, _random_tree, _reference, _rel, _run_variant

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed for the CPU emulation")]

LIMIT = 227 * 1024


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    with emulated(emulation_build_dir(tmp_path_factory, "emu8")) as made:
        yield made


def _run8(c, plan, launches, options=(), return_delta=True, **kw):
    return _run_variant(c, plan, launches, 8, options, return_delta, **kw)


PATHS_KERNELS = ["gdn_tree_paths_solve", "gdn_tree_verify_paths"]  # the solve kernel, then the verify kernel


# (name, trees, h, hv, K, V, P8_BV, state index dtype)
CASES = [
    ("128_nodes_depth_16", [_bounded_tree(128, _g(1))], 1, 2, 128, 64, 64, torch.int64),
    ("mixed_batch_chain_star_single", [_bounded_tree(40, _g(2)), torch.arange(-1, 16), torch.tensor([-1]),
                                       torch.tensor([-1] + [0] * 30)], 2, 4, 64, 64, 64, torch.int32),
    ("bv32_two_slices", [_bounded_tree(70, _g(3), 9), _random_tree(12, _g(4))], 1, 3, 32, 64, 32, torch.int64),
    ("node_order_not_level_order", [_depth_first(12, 20), _bounded_tree(33, _g(5))], 1, 1, 32, 32, 32, torch.int32),
]


@pytest.mark.parametrize("name, trees, h, hv, kd, vd, bv, idx_dtype", CASES, ids=[c[0] for c in CASES])
def test_v8_matches_float64_reference(launches, name, trees, h, hv, kd, vd, bv, idx_dtype):
    c = _case(trees, h, hv, kd, vd, torch.bfloat16, seed=len(name), idx_dtype=idx_dtype)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    o_ref, d_ref = _reference(c)
    names, o8, d8 = _run8(c, plan, launches, (f"-DP8_BV={bv}",))
    assert names == PATHS_KERNELS
    assert launches[0][1] == (1, h, len(trees))  # a solve CTA per request and q/k head
    assert launches[1][1] == (hv // h * (vd // bv), h, len(trees))  # a q/k head's CTAs along x, q/k heads, requests
    assert _rel(o8, o_ref) <= 3e-3, _rel(o8, o_ref)
    assert _rel(d8, d_ref) <= 1e-5, _rel(d8, d_ref)
    _, o_only, _ = _run8(c, plan, launches, (f"-DP8_BV={bv}",), return_delta=False)  # no delta buffer: the same o
    assert torch.equal(o_only, o8)


def test_v8_block_v_warps_and_stages_agree(launches):
    # the columns and warps per CTA change which warp computes a projection, the copy groups when it starts and
    # the nodes a warp serves in phase 3 which lanes sum an output, not their arithmetic: identical outputs
    c = _case([_bounded_tree(50, _g(20)), torch.tensor([-1, 0, 0, 1])], 1, 2, 64, 64, torch.bfloat16, seed=21)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    _, o64, d64 = _run8(c, plan, launches, ("-DP8_BV=64",))
    for options in (("-DP8_BV=32",), ("-DP8_BV=32", "-DP8_WARPS=8"), ("-DP8_BV=64", "-DP8_WARPS=8"),
                    ("-DP8_STAGES=1",), ("-DP8_OUTW=1",), ("-DP8_OUTW=2",), ("-DP8_BV=32", "-DP8_OUTW=1"),
                    ("-DP8_BV=32", "-DP8_OUTW=2")):
        _, o, d = _run8(c, plan, launches, options)
        assert torch.equal(o, o64) and torch.equal(d, d64), options
        made, _, _ = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], variant=8, extra_options=options)
        assert dict(made)["gdn_tree_verify_paths"].config[1] == (256 if "-DP8_WARPS=8" in options else 512, 1, 1)


def test_v8_solve_kernel_launch_and_timeline(launches):
    # the solve kernel, then the verify kernel with programmatic dependent launch; with a timeline buffer every solve
    # CTA (one per request and q/k head) writes its two marks (the emulation's timers read 0), and the outputs are
    # the same
    c = _case([_bounded_tree(40, _g(28)), torch.tensor([-1, 0, 0])], 2, 4, 64, 64, torch.bfloat16, seed=29)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    _, o, d = _run8(c, plan, launches)
    assert launches.programmatic == [False, True]
    marks = torch.full((4, kgdn.PATHS_SOLVE_MARKS, 2), -1, dtype=torch.int64)
    _, ot, dt = _run8(c, plan, launches, timeline8_solve=marks)
    assert launches[0][1] == (1, 2, 2)
    assert torch.equal(marks, torch.zeros_like(marks)) and torch.equal(ot, o) and torch.equal(dt, d)


def _solve_kernel_check(c, plan, scale=None, use_qk_l2norm=True):
    """gdn_tree_paths_solve alone against ``paths_solve_reference``: the same entries written (its output
    NaN-poisoned first), each value head's rows of T and W within 1e-5 of float64's."""
    made, _, _ = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                      c["state_indices"], variant=8, scale=scale, use_qk_l2norm=use_qk_l2norm)
    solve = dict(made)["gdn_tree_paths_solve"]
    solve.tw.fill_(float("nan"))
    solve()
    got = solve.tw.view(c["v"].shape[1], 2, -1)
    want = kgdn.paths_solve_reference(plan, c["q"], c["k"], c["g"], c["beta"], scale, use_qk_l2norm)
    assert torch.equal(got.isnan(), want.isnan())
    live = ~want.isnan()
    assert _rel(got[:, 0][live[:, 0]], want[:, 0][live[:, 0]]) <= 1e-5  # T
    assert _rel(got[:, 1][live[:, 1]], want[:, 1][live[:, 1]]) <= 1e-5  # W


@pytest.mark.parametrize("name", ["128_nodes_depth_16", "mixed_batch_chain_star_single", "node_order_not_level_order"])
def test_v8_solve_kernel_matches_float64_rows(launches, name):
    # every ancestor pair's T_ij and W_ij at its path entry, per value head, on the float64 reference's entries only
    _, trees, h, hv, kd, vd, _, _ = next(c for c in CASES if c[0] == name)
    c = _case(trees, h, hv, kd, vd, torch.bfloat16, seed=len(name) + 3)
    _solve_kernel_check(c, TreePlan.build(c["parents"], c["cu_nodes"]))
    if name == "node_order_not_level_order":
        _solve_kernel_check(c, TreePlan.build(c["parents"], c["cu_nodes"]), scale=0.3, use_qk_l2norm=False)


def test_v8_solve_kernel_leaves_fixed_layout_padding_alone(launches):
    # a full CUDA graph's fixed-layout plan pads each request's pair table to a chain's: nothing written there
    n = 17
    trees = [_bounded_tree(n, _g(70)), torch.arange(-1, n - 1), _depth_first(8, 8)]
    c = _case(trees, 2, 4, 64, 64, torch.bfloat16, seed=71)
    plan = TreePlan.build_into(torch.zeros(TreePlan.fixed_size(len(trees), n), dtype=torch.int32), c["parents"],
                               c["cu_nodes"], n)
    assert plan.num_pairs > sum(int(d) + 1 for d in plan.depth.tolist())  # padding entries exist
    _solve_kernel_check(c, plan)


def test_v8_in_kernel_solve_and_clusters(launches):
    # P8_PREGRAM=0: the solve in the verify kernel (one launch), by the solve kernel's arithmetic (p8_gram_tasks,
    # p8_norms, p8_scale_entries, p8_path_row): bit for bit as the two launches, and within the bars. A cluster of a q/k head's CTAs
    # sharing them (P8_CLUSTER=3) changes which CTA computes a tile, not its arithmetic: bit for bit. A cluster with
    # the solve kernel is refused, as is one that does not divide a q/k head's CTAs
    c = _case([_bounded_tree(70, _g(27)), torch.tensor([-1, 0, 1, 2, 3])], 1, 3, 128, 64, torch.bfloat16, seed=27)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    o_ref, d_ref = _reference(c)
    names, o, d = _run8(c, plan, launches, ("-DP8_PREGRAM=0",))
    assert names == ["gdn_tree_verify_paths"]
    assert _rel(o, o_ref) <= 3e-3 and _rel(d, d_ref) <= 1e-5, (_rel(o, o_ref), _rel(d, d_ref))
    names, o1, d1 = _run8(c, plan, launches)
    assert names == PATHS_KERNELS and torch.equal(o1, o) and torch.equal(d1, d)
    made, _, _ = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                      c["state_indices"], variant=8, extra_options=("-DP8_PREGRAM=0", "-DP8_CLUSTER=3"))
    assert dict(made)["gdn_tree_verify_paths"].config[3] == 3
    _, o3, d3 = _run8(c, plan, launches, ("-DP8_PREGRAM=0", "-DP8_CLUSTER=3"))
    assert torch.equal(o3, o) and torch.equal(d3, d)
    for bad in (("-DP8_CLUSTER=3",), ("-DP8_PREGRAM=0", "-DP8_CLUSTER=2"), ("-DP8_PREGRAM=0", "-DP8_CLUSTER=9"),
                ("-DP8_PREGRAM=0", "-DP8_CLUSTER=0")):
        with pytest.raises(ValueError, match="a cluster of 1 to 8 CTAs that divides the 3 CTAs of a q/k head"):
            kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"], c["state_indices"],
                                 variant=8, extra_options=bad)


def test_v8_two_part_split_is_within_the_bars(launches):
    # P8_SPLIT=2 drops S0's third bf16 part from the K projection (each element then within 2^-17 of itself): still
    # far inside the bars, and not the same numbers as the three-part build. The Q projection (two parts by default,
    # P8_QSPLIT) reaches only O: with three parts delta is the same bit for bit and O within the bars
    c = _case([_bounded_tree(60, _g(25))], 1, 1, 128, 64, torch.bfloat16, seed=26)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    o_ref, d_ref = _reference(c)
    _, o3, d3 = _run8(c, plan, launches)
    _, o2, d2 = _run8(c, plan, launches, ("-DP8_SPLIT=2",))
    assert _rel(o2, o_ref) <= 3e-3 and _rel(d2, d_ref) <= 1e-5, (_rel(o2, o_ref), _rel(d2, d_ref))
    assert not torch.equal(d2, d3)
    _, oq3, dq3 = _run8(c, plan, launches, ("-DP8_QSPLIT=3",))
    assert torch.equal(dq3, d3) and _rel(oq3, o_ref) <= 3e-3, _rel(oq3, o_ref)


def test_v8_without_l2norm_and_with_a_scale(launches):
    c = _case([_bounded_tree(45, _g(30))], 1, 2, 32, 32, torch.bfloat16, seed=31)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    o_ref, d_ref = _reference(c, scale=0.3, use_qk_l2norm=False)
    _, o8, d8 = _run8(c, plan, launches, scale=0.3, use_qk_l2norm=False)
    assert _rel(o8, o_ref) <= 3e-3 and _rel(d8, d_ref) <= 1e-5, (_rel(o8, o_ref), _rel(d8, d_ref))


def test_v8_on_fixed_layout_plans(launches):
    # full CUDA graphs: trees of 17 nodes in the fixed layout (capacity depth 16: version 8 takes it); at 18
    # nodes the capacity depth is 17 and version 6 runs, whatever the plan's depth bound
    n = 17
    trees = [_bounded_tree(n, _g(40)), torch.arange(-1, n - 1), _depth_first(8, 8)]
    c = _case(trees, 1, 2, 64, 64, torch.bfloat16, seed=42)
    o_ref, d_ref = _reference(c)
    plan = TreePlan.build_into(torch.zeros(TreePlan.fixed_size(len(trees), n), dtype=torch.int32), c["parents"],
                               c["cu_nodes"], n, depth_bound=15)
    names, o8, d8 = _run8(c, plan, launches)
    assert names == PATHS_KERNELS
    assert _rel(o8, o_ref) <= 3e-3 and _rel(d8, d_ref) <= 1e-5, (_rel(o8, o_ref), _rel(d8, d_ref))
    c18 = _case([_bounded_tree(18, _g(43), 5)], 1, 2, 64, 64, torch.bfloat16, seed=44)
    plan18 = TreePlan.build_into(torch.zeros(TreePlan.fixed_size(1, 18), dtype=torch.int32), c18["parents"],
                                 c18["cu_nodes"], 18, depth_bound=5)
    assert kgdn.paths_unsupported_reason(plan18, torch.bfloat16, 64, 64, LIMIT) == \
        "paths of up to 18 nodes: version 8 takes at most 17"
    names, _, _ = _run8(c18, plan18, launches)
    assert names == ["gdn_tree_verify_grouped"]


def test_v8_runs_version_6_where_it_does_not_apply(launches):
    # a path of 18 nodes runs version 6 with the same outputs as asking for version 6
    c = _case([torch.arange(-1, 17), torch.tensor([-1])], 1, 2, 32, 32, torch.bfloat16, seed=51)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    assert kgdn.paths_unsupported_reason(plan, torch.bfloat16, 32, 32, LIMIT) == \
        "paths of up to 18 nodes: version 8 takes at most 17"
    names, o8, d8 = _run8(c, plan, launches)
    assert names == ["gdn_tree_verify_grouped"]
    launches.clear()
    made, o6, d6 = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                        c["state_indices"], return_delta=True, variant=6)
    for _, fn in made:
        fn()
    assert torch.equal(o8, o6) and torch.equal(d8, d6)
    # float32 inputs: version 6 and then version 3 (two kernels)
    c32 = _case([_bounded_tree(12, _g(52))], 1, 2, 32, 32, torch.float32, seed=53)
    plan32 = TreePlan.build(c32["parents"], c32["cu_nodes"])
    names, _, _ = _run8(c32, plan32, launches)
    assert names == ["gdn_tree_pairs", "gdn_tree_verify_main"]


def test_v8_support_and_shared_memory():
    big = TreePlan.build(_bounded_tree(129, _g(60)), torch.tensor([0, 129]))
    assert kgdn.paths_unsupported_reason(big, torch.bfloat16, 128, 128, LIMIT) == \
        "a tree of 129 nodes: version 8 takes at most 128"
    plan = TreePlan.build(_bounded_tree(128, _g(61)), torch.tensor([0, 128]))
    assert kgdn.paths_unsupported_reason(plan, torch.bfloat16, 128, 128, LIMIT) is None
    assert "float16" in kgdn.paths_unsupported_reason(plan, torch.float16, 128, 128, LIMIT)
    assert "not a multiple of 64" in kgdn.paths_unsupported_reason(plan, torch.bfloat16, 128, 96, LIMIT, 64)
    assert "32 or 64 columns" in kgdn.paths_unsupported_reason(plan, torch.bfloat16, 128, 128, LIMIT, 16)
    assert "K=48 is not a multiple of 32" in kgdn.paths_unsupported_reason(plan, torch.bfloat16, 48, 128, LIMIT)
    # the 27B layer at n = 128: q, k rows and 64 S0 rows (136 words a row) outweigh R and the Q projection
    pairs = plan.max_pairs_per_request
    assert kgdn.paths_smem_bytes(128, 64, 128, pairs) == 4 * (
        128 * 136 + 64 * 136 + 128 * 32 + 3 * ((pairs + 3) & ~3) + 13 * 128 + 132)
    assert kgdn.paths_smem_bytes(128, 64, 128, pairs, solve_kernel=False) == 4 * (
        128 * 136 + 64 * 136 + 128 * 32 + 7 * ((pairs + 3) & ~3) + 13 * 128 + 132)
    # its solve kernel at 3 value heads per q/k head: the q, k rows, 5 + 2 * 3 tables by path entry, pair offsets,
    # per-node tables and per value head g, beta, G
    assert kgdn.paths_solve_smem_bytes(128, 128, pairs, 3) == 4 * (
        128 * 136 + 11 * ((pairs + 3) & ~3) + 132 + 9 * 128 + 9 * 128)
    assert kgdn.paths_unsupported_reason(plan, torch.bfloat16, 128, 128, LIMIT, 64, 3) is None
    assert "solve kernel needs" in kgdn.paths_unsupported_reason(plan, torch.bfloat16, 128, 128, LIMIT, 64, 40)
    need = kgdn.paths_smem_bytes(128, 64, 128, pairs)
    assert need <= LIMIT
    assert kgdn.paths_unsupported_reason(plan, torch.bfloat16, 128, 128, need) is None
    assert "needs" in kgdn.paths_unsupported_reason(plan, torch.bfloat16, 128, 128, need - 4)


def test_v8_warps_two_ctas_a_sm_where_they_fit_and_the_grid_passes_the_sms():
    # the 27B layer (48 value heads, V = 128, BV 64: 96 CTAs a request) on 132 SMs: 8 warps once a second wave would
    # start (batch 2, or batch 1 at BV 32) if two CTAs (and their reserved KB) fit 228 KB; 16 at batch 1 and for
    # n = 128 (one CTA fills it)
    def plan_of(trees):
        parents = torch.cat(trees)
        cu = torch.tensor([0] + [len(t) for t in trees]).cumsum(0)
        return TreePlan.build(parents, cu)

    n65 = [_bounded_tree(65, _g(62 + i)) for i in range(2)]
    p1, p2 = plan_of(n65[:1]), plan_of(n65)
    smem = kgdn.paths_smem_bytes(128, 64, 65, p2.max_pairs_per_request)
    assert 2 * (smem + kgdn.CTA_SMEM_RESERVED) <= kgdn.SM_SMEM_BYTES  # this tree's pairs fit twice
    assert kgdn.paths_warps(p1, 16, 48, 128, 128, 64, 132) == 16  # 96 CTAs: one wave
    assert kgdn.paths_warps(p2, 16, 48, 128, 128, 64, 132) == 8
    assert kgdn.paths_warps(p2, 16, 48, 128, 128, 64, 192) == 16  # 192 CTAs on 192 SMs: one wave
    assert kgdn.paths_warps(p2, 16, 48, 128, 128, 64, 132, ("-DP8_WARPS=16",)) == 16  # a test's or bench's choice
    p128 = plan_of([_bounded_tree(128, _g(64 + i)) for i in range(2)])
    assert 2 * (kgdn.paths_smem_bytes(128, 64, 128, p128.max_pairs_per_request) + 1024) > kgdn.SM_SMEM_BYTES
    assert kgdn.paths_warps(p128, 16, 48, 128, 128, 64, 132) == 16
    assert kgdn.paths_warps(p1, 16, 48, 128, 128, 32, 132) == 8  # 32 columns: 192 CTAs at batch 1, smaller CTAs

"""Verify kernel version 6 (cuda/gdn_tree_verify_grouped.cu: one kernel, a CTA per request, q/k head
and 16 V columns for all value heads of the group; pair products and projections on bf16 tensor
cores) through the CPU emulation, against the float64 reference ``vllm_tfm.verify.gdn.gdn_tree_verify``.

Bars as for the other versions with 16-bit inputs: o <= 3e-3 relative (rounded to bf16), delta <= 1e-5
(the three-part bf16 split of S0 keeps the projections float32-accurate); every NaN-poisoned output
element written; the state untouched. Trees: random, chain, star, a single node, depth > 64, several
requests of different sizes in one call, node counts that are not multiples of the 16-row tiles.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.plan import TreePlan
from vllm_tfm.verify import gdn as ref_gdn

from _gdn_emu_cases import _bounded_tree, _case, _deep_tree, _g, _random_tree, _rel  # tests/cpu helper module

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed for the CPU emulation")]



@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    sys.path.insert(0, str(CUDA_DIR / "host_emu"))
    try:
        from emulate import emulated_kernels
    finally:
        sys.path.pop(0)
    try:
        with emulated_kernels(tmp_path_factory.mktemp("emu")) as launches:
            yield launches
    except subprocess.CalledProcessError as exc:  # a compiler without C++20 <barrier>
        pytest.skip(f"g++ could not build the emulation: {exc.stderr[:300]}")


def _run(c, plan, variant=6, return_delta=True):
    before = c["ssm_state"].clone()
    o = torch.full(c["v"].shape, float("nan"), dtype=c["v"].dtype)
    d = torch.full(c["v"].shape, float("nan")) if return_delta else None
    kgdn.gdn_tree_verify_planned(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"], c["state_indices"],
                                 return_delta=return_delta, out=o, delta_out=d, variant=variant)
    assert not o.isnan().any(), "o left unwritten"
    assert d is None or not d.isnan().any(), "delta left unwritten"
    assert torch.equal(c["ssm_state"], before), "the verify wrote the state"
    return o, d


def _launch6(c, plan, **kw):
    """Version 6 through ``verify_launches`` (keyword arguments: threads6, extra_options), every launch run;
    (kernel names, o, delta)."""
    launches, o, d = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], return_delta=True, variant=6, **kw)
    for _, fn in launches:
        fn()
    return [name for name, _ in launches], o, d


def _four_trees_v128(tree_seed, seed):
    """A 150-node random tree, a chain of 17, a single node and a star of 21 at 2 q/k heads, 4 value heads,
    K = 32, V = 128 (8 V slices: clusters up to 8): (case, plan, o and delta of the float64 reference)."""
    trees = [_random_tree(150, _g(tree_seed)), torch.arange(-1, 16), torch.tensor([-1]), torch.tensor([-1] + [0] * 20)]
    c = _case(trees, 2, 4, 32, 128, torch.bfloat16, seed=seed)
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    return c, TreePlan.build(c["parents"], c["cu_nodes"]), o_ref, d_ref


# (name, trees, h, hv, K, V, state index dtype)
CASES = [
    ("k128_group3_random_chain_single", [_random_tree(40, _g(1)), torch.arange(-1, 9), torch.tensor([-1])], 1, 3, 128,
     32, torch.int64),
    ("k32_group2_n128_and_star", [_random_tree(128, _g(2)), torch.tensor([-1] + [0] * 32)], 2, 4, 32, 16, torch.int32),
    ("k64_group1_depth_over_64", [_deep_tree(90, _g(3))], 1, 1, 64, 32, torch.int64),
    ("k32_group3_chain_of_17_and_two_nodes", [torch.arange(-1, 16), torch.tensor([-1, 0])], 1, 3, 32, 16, torch.int32),
]


@pytest.mark.parametrize("name, trees, h, hv, kd, vd, idx_dtype", CASES, ids=[c[0] for c in CASES])
def test_v6_matches_float64_reference(emulated, name, trees, h, hv, kd, vd, idx_dtype):
    c = _case(trees, h, hv, kd, vd, torch.bfloat16, seed=len(name), idx_dtype=idx_dtype)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    emulated.clear()
    o6, d6 = _run(c, plan)
    assert [name for name, _, _ in emulated] == ["gdn_tree_verify_grouped"]
    assert _rel(o6, o_ref) <= 3e-3, _rel(o6, o_ref)
    assert _rel(d6, d_ref) <= 1e-5, _rel(d6, d_ref)
    if name.startswith("k32_group3"):  # no delta buffer: the same outputs
        o_only, _ = _run(c, plan, return_delta=False)
        assert torch.equal(o_only, o6)


def test_v6_without_l2norm_and_with_a_scale(emulated):
    c = _case([_random_tree(21, _g(4))], 1, 2, 32, 16, torch.bfloat16, seed=5)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, scale=0.3, use_qk_l2norm=False, return_delta=True)
    o6, d6 = kgdn.gdn_tree_verify_planned(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], scale=0.3, use_qk_l2norm=False, return_delta=True,
                                          variant=6)
    assert _rel(o6, o_ref) <= 3e-3 and _rel(d6, d_ref) <= 1e-5


def test_v6_runs_version_3_where_it_does_not_apply(emulated, monkeypatch):
    # float32 inputs, and a tree that does not fit the device's shared memory, run version 3's two kernels
    # (bit for bit version 3); the fit is checked against the device limit, here lowered to 40 KB
    bf16_tree = _random_tree(40, _g(6))
    cases = ((torch.float32, _random_tree(20, _g(6)), 227 * 1024), (torch.bfloat16, bf16_tree, 40 * 1024))
    for dtype, tree, limit in cases:
        monkeypatch.setattr(kgdn, "device_smem_optin", lambda index, limit=limit: limit)
        c = _case([tree], 1, 3, 32, 16, dtype, seed=7)
        plan = TreePlan.build(c["parents"], c["cu_nodes"])
        assert kgdn.grouped_unsupported_reason(plan, dtype, 1, 3, 32, 16, limit) is not None
        emulated.clear()
        o6, d6 = _run(c, plan, variant=6)
        assert [name for name, _, _ in emulated] == ["gdn_tree_pairs", "gdn_tree_verify_main"]
        o3, d3 = _run(c, plan, variant=3)
        assert torch.equal(o6, o3) and torch.equal(d6, d3)
    # a 130-node chain (8,515 pairs) does not fit 227 KB at K = 32
    chain = TreePlan.build(torch.arange(-1, 129), torch.tensor([0, 130]))
    reason = kgdn.grouped_unsupported_reason(chain, torch.bfloat16, 1, 3, 32, 16, 227 * 1024)
    assert reason is not None and "8515 pairs" in reason, reason


def test_v6_shared_memory_mirror():
    # the 27B layer at n = 128 with 900 pairs fits the H200's 227 KB; a 200-node chain (20,100 pairs) does not
    assert kgdn.grouped_smem_bytes(128, 3, 128, 900) <= 227 * 1024
    assert kgdn.grouped_smem_bytes(128, 3, 200, 20100) > 227 * 1024
    # the raw pair products share the R / Q-projection region: more pairs grow it only past its size
    base = kgdn.grouped_smem_bytes(128, 3, 33, 16)
    # pj, pa, X, Y, T of 3 heads: 11 words per entry (the level solve has no pa and no T: 7)
    assert kgdn.grouped_smem_bytes(128, 3, 33, 20) - base == 4 * 11 * 4
    levels = kgdn.grouped_smem_bytes(128, 3, 33, 16, solve_levels=True)
    assert kgdn.grouped_smem_bytes(128, 3, 33, 20, solve_levels=True) - levels == 4 * 7 * 4
    assert base - levels == 4 * 4 * 16  # pa and T of 3 heads: 4 words for each of the 16 entries
    # the 27B shape's full-graph plan at B = 64 (65 nodes, 2,145 pairs) fits with either solve
    assert kgdn.grouped_smem_bytes(128, 3, 65, 2145) <= 227 * 1024


def test_v6_solve_choice():
    limit = 227 * 1024
    shallow = TreePlan.build(_random_tree(64, _g(20)), torch.tensor([0, 64]))
    assert shallow.max_depth <= 16 and kgdn.grouped_solve(shallow, 128, 3, limit) == 1
    wide = TreePlan.build(torch.tensor([-1] + [0] * 127), torch.tensor([0, 128]))  # 128 nodes, depth 1
    assert kgdn.grouped_solve(wide, 128, 3, limit) == 1
    deep100 = TreePlan.build(_deep_tree(100, _g(21)), torch.tensor([0, 100]))
    assert kgdn.grouped_solve(deep100, 128, 3, limit) == 0  # deeper than a register path
    deep = TreePlan.build(torch.arange(-1, 17), torch.tensor([0, 18]))  # a chain of 18: depth 17
    assert kgdn.grouped_solve(deep, 128, 3, limit) == 0
    # the path solve's tables must fit: the level solve takes a tree whose path tables do not
    chain64 = TreePlan.build(torch.arange(-1, 63), torch.tensor([0, 64]))
    tight = kgdn.grouped_smem_bytes(128, 3, 64, chain64.max_pairs_per_request, solve_levels=True)
    assert kgdn.grouped_solve(chain64, 128, 3, tight, ("-DG6_SOLVE=1",)) == 1  # an explicit option decides
    star = TreePlan.build(torch.tensor([-1] + [0] * 40), torch.tensor([0, 41]))
    need = kgdn.grouped_smem_bytes(128, 3, 41, star.max_pairs_per_request)
    assert kgdn.grouped_solve(star, 128, 3, need) == 1 and kgdn.grouped_solve(star, 128, 3, need - 4) == 0
    assert kgdn.grouped_solve(star, 128, 3, need, ("-DG6_SOLVE=0",)) == 0


def test_v6_solve_choice_on_fixed_layout_plans():
    # the full graphs' fixed layout says depth n - 1 (its capacity); its depth_bound (the drafter's depth,
    # runtime/full_graphs.py) decides version 6's solve instead, and nothing else
    limit, n = 227 * 1024, 33
    tree = _random_tree(n, _g(60))

    def fixed(bound):
        return TreePlan.build_into(torch.zeros(TreePlan.fixed_size(1, n), dtype=torch.int32), tree,
                                   torch.tensor([0, n]), n, depth_bound=bound)

    unbounded = fixed(None)
    assert unbounded.max_depth == n - 1 and unbounded.depth_bound is None
    assert kgdn.grouped_solve(unbounded, 128, 3, limit) == 0
    for bound, solve in ((0, 1), (15, 1), (16, 1), (17, 0), (31, 0)):
        plan = fixed(bound)
        assert (plan.depth_bound, plan.max_depth) == (bound, n - 1)
        assert kgdn.grouped_solve(plan, 128, 3, limit) == solve, bound
    assert fixed(n - 1).depth_bound is None and fixed(100).depth_bound is None  # no tighter than the capacity
    with pytest.raises(ValueError, match="depth_bound must be >= 0, got -1"):
        fixed(-1)
    # the path solve's tables must still fit (at the fixed layout's n (n + 1) / 2 pairs)
    need = kgdn.grouped_smem_bytes(128, 3, n, fixed(15).max_pairs_per_request)
    assert kgdn.grouped_solve(fixed(15), 128, 3, need) == 1 and kgdn.grouped_solve(fixed(15), 128, 3, need - 4) == 0
    # versions 3-5 and the commit size their tables by max_depth, which the bound leaves alone
    assert kgdn._pair_capacity(fixed(15)) == kgdn._pair_capacity(unbounded)


def test_v6_on_fixed_layout_plans_with_a_depth_bound_takes_the_path_solve(emulated):
    # full CUDA graphs: R trees of n nodes in the fixed layout; with the drafter's depth as the bound version 6
    # runs its path solve, exact also for a tree deeper than the bound (a chain of 33: paths of more than
    # G6_PATH_REG entries are solved in shared memory, the others in registers, in the same CTA)
    n = 33
    trees = [_random_tree(n, _g(61)), torch.arange(-1, n - 1), torch.tensor([-1] + [0] * (n - 1))]
    c = _case(trees, 1, 3, 32, 16, torch.bfloat16, seed=62)
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    outs = []
    for bound, solve in ((None, 0), (15, 1)):
        plan = TreePlan.build_into(torch.zeros(TreePlan.fixed_size(len(trees), n), dtype=torch.int32), c["parents"],
                                   c["cu_nodes"], n, depth_bound=bound)
        assert kgdn.grouped_solve(plan, 32, 3, 227 * 1024) == solve
        emulated.clear()
        o, d = _run(c, plan)
        smem = kgdn.grouped_smem_bytes(32, 3, n, plan.max_pairs_per_request, solve_levels=solve == 0)
        assert [(name, shared) for name, _, shared in emulated] == [("gdn_tree_verify_grouped", smem)]
        assert _rel(o, o_ref) <= 3e-3 and _rel(d, d_ref) <= 1e-5, (bound, _rel(o, o_ref), _rel(d, d_ref))
        outs.append(d)
    assert _rel(outs[1], outs[0]) <= 1e-6 and not torch.equal(outs[1], outs[0])  # both solves ran


def test_v6_path_solve_equals_level_solve(emulated):
    # G6_SOLVE=1 (the default: path rows of (I + X)^-1 and Y (I + X)^-1, then gathers) against G6_SOLVE=0
    # (the level-by-level substitution): the same function, sums in another order. Both within the bars
    # against float64 and within float32 rounding of each other; trees: random, a chain, a star, depth > 64
    c = _case([_random_tree(45, _g(10)), torch.arange(-1, 12), torch.tensor([-1] + [0] * 9), _deep_tree(80, _g(12))],
              1, 3, 32, 16, torch.bfloat16, seed=11)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    res = []
    for opts in (("-DG6_SOLVE=1",), ("-DG6_SOLVE=0",)):
        names, o, d = _launch6(c, plan, extra_options=opts)
        assert names == ["gdn_tree_verify_grouped"]
        assert _rel(o, o_ref) <= 3e-3 and _rel(d, d_ref) <= 1e-5, (opts, _rel(o, o_ref), _rel(d, d_ref))
        res.append((o, d))
    assert _rel(res[0][1], res[1][1]) <= 1e-6, _rel(res[0][1], res[1][1])
    assert not torch.equal(res[0][1], res[1][1])  # the two solves do differ in their rounding: both ran


def test_v6_with_256_threads_equals_512_bit_for_bit(emulated):
    # the CTA size changes which warp computes a tile, not a tile's arithmetic: identical outputs
    c = _case([_random_tree(50, _g(8)), torch.arange(-1, 20), torch.tensor([-1])], 1, 3, 64, 32, torch.bfloat16, seed=9)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    outs = []
    for threads in (256, 512):
        emulated.clear()
        _, o, d = _launch6(c, plan, threads6=threads)
        assert [(name, grid) for name, grid, _ in emulated] == [("gdn_tree_verify_grouped", (2, 1, 3))]
        outs.append((o, d))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    assert _rel(outs[0][0], o_ref) <= 3e-3 and _rel(outs[0][1], d_ref) <= 1e-5


def test_v6_cluster_equals_no_cluster_bit_for_bit(emulated):
    # G6_CLUSTER: the V / 16 CTAs of a (request, q/k head) split the gram tiles and store each product into
    # every CTA's shared memory (distributed shared memory, emulated as concurrent blocks). Same tiles, same
    # arithmetic: the outputs of every cluster size equal those without one, bit for bit, at 256 threads (8
    # warps: 78 tiles of the 150-node tree are several rounds per CTA) and 512; each against float64 too
    c, plan, o_ref, d_ref = _four_trees_v128(30, 31)
    for threads, clusters in ((256, (1, 2, 4, 8)), (512, (1, 4))):
        outs = []
        for cluster in clusters:
            emulated.clear()
            _, o, d = _launch6(c, plan, threads6=threads, extra_options=(f"-DG6_CLUSTER={cluster}",))
            assert [(name, grid) for name, grid, _ in emulated] == [("gdn_tree_verify_grouped", (8, 2, 4))]
            assert emulated.clusters == [cluster]
            outs.append((o, d))
        assert _rel(outs[0][0], o_ref) <= 3e-3 and _rel(outs[0][1], d_ref) <= 1e-5
        for cluster, (o, d) in zip(clusters[1:], outs[1:]):
            assert torch.equal(o, outs[0][0]) and torch.equal(d, outs[0][1]), (threads, cluster)


def test_v6_cluster_choice():
    n128 = TreePlan.build(_random_tree(128, _g(32)), torch.tensor([0, 128]))
    n80 = TreePlan.build(_random_tree(80, _g(33)), torch.tensor([0, 80]))
    n81 = TreePlan.build(_random_tree(81, _g(34)), torch.tensor([0, 81]))
    # sm_90 and more gram tiles than warps (n = 128: 36 tiles; n = 80: 15, one round at 16 warps): a cluster
    assert kgdn.grouped_cluster(n128, 128, 512, 9) == kgdn.GROUPED_CLUSTER == 2
    assert kgdn.grouped_cluster(n81, 128, 512, 9) == 2 and kgdn.grouped_cluster(n80, 128, 512, 9) == 1
    assert kgdn.grouped_cluster(n80, 128, 256, 9) == 2  # 8 warps: two rounds
    assert kgdn.grouped_cluster(n128, 128, 512, 8) == 1  # no clusters before sm_90
    assert kgdn.grouped_cluster(n128, 16, 512, 9) == 1  # 1 V slice: no cluster of 2
    assert kgdn.grouped_cluster(n80, 128, 512, 9, ("-DG6_CLUSTER=8",)) == 8  # an explicit option decides
    with pytest.raises(ValueError, match="G6_CLUSTER=4: a cluster of 1, 2, 4 or 8 CTAs that divides the 2 V slices"):
        kgdn.grouped_cluster(n80, 32, 512, 9, ("-DG6_CLUSTER=4",))
    with pytest.raises(ValueError, match="G6_CLUSTER=3: "):
        kgdn.grouped_cluster(n80, 128, 512, 9, ("-DG6_CLUSTER=3",))


def test_v6_threads_choice():
    plan1 = TreePlan.build(torch.tensor([-1, 0, 0]), torch.tensor([0, 3]))
    plan8 = TreePlan.build(torch.tensor([-1, 0, 0] * 8), torch.tensor([3 * r for r in range(9)]))
    small = kgdn.grouped_smem_bytes(128, 3, 3, 5)
    # batch 1 at the 27B shape: 128 CTAs for 132 SMs, one each; batch 8: 1,024 CTAs, two per SM when they fit
    assert kgdn.grouped_threads(plan1, 16, 128, small, kgdn.SM_SMEM_BYTES, 132) == 512
    assert kgdn.grouped_threads(plan8, 16, 128, small, kgdn.SM_SMEM_BYTES, 132) == 256
    assert kgdn.grouped_threads(plan8, 16, 128, 120 * 1024, kgdn.SM_SMEM_BYTES, 132) == 512


def test_runtime_verify_variant_follows_the_measured_policy():
    # bench/NOTES.md sections 34 and 37: version 6 where the H200 measured it faster than version 3; section 73:
    # version 7 for trees of up to 32 nodes on grids of more than one wave
    limit, sms = 227 * 1024, 132

    def trees(nodes: int, requests: int, seed: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
        parents = torch.cat([_random_tree(nodes, _g(seed + r)) for r in range(requests)])
        return parents, torch.arange(0, nodes * requests + 1, nodes)

    def plan(nodes: int, requests: int) -> TreePlan:
        return TreePlan.build(*trees(nodes, requests))

    def fixed(nodes: int, requests: int, depth_bound: int | None) -> TreePlan:
        return TreePlan.build_into(torch.zeros(TreePlan.fixed_size(requests, nodes), dtype=torch.int32),
                                   *trees(nodes, requests, 40), nodes, depth_bound=depth_bound)

    def variant(p: TreePlan, dtype=torch.bfloat16) -> int:  # the 27B shape: H = 16, HV = 48, K = V = 128
        return kgdn.runtime_verify_variant(p, dtype, 16, 48, 128, 128, limit, sms)

    # version 7 first (section 73) for trees of up to 32 nodes (B = 16's 17) where version 6's grid is more than one
    # wave (batch 2 and more), bf16 only; version 6 at batch 1 (one wave: 128 CTAs) and for larger trees
    assert variant(plan(17, 2)) == 7 and variant(plan(17, 8)) == 7 and variant(plan(32, 32)) == 7
    assert variant(fixed(17, 8, 15)) == 7 and variant(fixed(32, 2, None)) == 7
    assert variant(plan(17, 1)) == 6 and variant(fixed(17, 1, 15)) == 6 and variant(plan(33, 8)) == 6
    assert variant(plan(17, 8), torch.float32) == 3 and variant(plan(17, 8), torch.float16) == 3
    assert kgdn.runtime_verify_variant(plan(17, 8), torch.bfloat16, 16, 48, 128, 128, kgdn.small_smem_bytes(128, 3, 32) - 4,
                                       sms) == 3  # neither version 7 nor version 6 fits
    assert variant(plan(33, 1)) == 6  # one wave: 128 CTAs
    # n = 65 on the full graphs' plans (version 8 takes per-step plans, below): two waves (256 CTAs <= 264) with the
    # path solve, not with the level solve (an unbounded fixed plan); three waves and more version 3
    assert variant(fixed(65, 2, 15)) == 6 and variant(fixed(65, 2, None)) == 3 and variant(fixed(65, 8, 15)) == 3
    # B = 32: every batch where version 6 takes its path solve (per-step plans, fixed plans with the drafter's
    # depth bound), version 3 on a fixed plan without one from three waves on (the level solve)
    assert variant(plan(33, 8)) == 6 and variant(plan(33, 32)) == 6
    assert variant(fixed(33, 8, 15)) == 6 and variant(fixed(33, 32, 15)) == 6 and variant(fixed(33, 1, None)) == 6
    assert variant(fixed(33, 2, None)) == 3 and variant(fixed(33, 8, None)) == 3
    assert variant(fixed(33, 8, 16)) == 6 and variant(fixed(33, 8, 17)) == 3
    assert variant(plan(33, 1), torch.float32) == 3 and variant(plan(33, 1), torch.float16) == 3  # bf16 only
    chain = TreePlan.build(torch.arange(-1, 127), torch.tensor([0, 128]))  # 8,256 pairs: does not fit
    assert kgdn.grouped_unsupported_reason(chain, torch.bfloat16, 16, 48, 128, 128, limit) is not None
    assert variant(chain) == 3
    # sections 76, 77: version 8 for trees of more than 33 nodes whose paths have at most 17 nodes (depth <= 16, a
    # DFlash block) where version 6's grid is more than one wave, and at batch 1 too from 65 nodes; bfloat16 only. A
    # full graph's fixed-layout plan of more than 17 nodes never runs it (its paths are bounded by its capacity, above)
    def shallow(nodes: int, requests: int, depth: int = 16) -> TreePlan:
        parents = torch.cat([_bounded_tree(nodes, _g(50 + r), depth) for r in range(requests)])
        return TreePlan.build(parents, torch.arange(0, nodes * requests + 1, nodes))

    assert variant(shallow(128, 1)) == 8 and variant(shallow(66, 1)) == 8 and variant(plan(128, 1)) == 8
    assert variant(shallow(65, 1)) == 8 and variant(shallow(64, 1)) == 6  # one wave: from 65 nodes (13.0 against 15.2 us)
    assert variant(shallow(65, 2)) == 8 and variant(shallow(65, 8)) == 8 and variant(plan(65, 3)) == 8
    assert variant(shallow(128, 32)) == 8 and variant(shallow(34, 2)) == 8
    assert variant(shallow(33, 8)) == 6 and variant(shallow(32, 8)) == 7
    assert variant(shallow(128, 8), torch.float32) == 3
    assert variant(shallow(65, 8, 17)) == 3  # paths of 18 nodes: version 6's level solve at three waves, so 3


def test_verify_version_setting(monkeypatch):
    from vllm_tfm.vllm_plugin.runtime.settings import VERIFY_VERSION_ENV, verify_version_setting

    monkeypatch.delenv(VERIFY_VERSION_ENV, raising=False)
    assert verify_version_setting() is None
    for raw, want in (("auto", None), (" 6 ", 6), ("3", 3), ("1", 1), ("7", 7), ("8", 8)):
        monkeypatch.setenv(VERIFY_VERSION_ENV, raw)
        assert verify_version_setting() == want
    for bad in ("9", "0", "v6", "-3", "3.0"):
        monkeypatch.setenv(VERIFY_VERSION_ENV, bad)
        with pytest.raises(ValueError, match=r"VLLM_TFM_GDN_VERIFY must be auto or one of \[1, 2, 3, 4, 5, 6, 7, 8\], got"):
            verify_version_setting()

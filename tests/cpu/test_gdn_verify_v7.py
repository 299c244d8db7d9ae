"""Verify kernel version 7 (cuda/gdn_tree_verify_small.cu: trees of at most 32 nodes, a CTA per request,
q/k head and 16 or 32 V columns for all value heads of the group, a warp per (value head, 16 V rows, half of
K)) through
the CPU emulation, against the float64 reference ``vllm_tfm.verify.gdn.gdn_tree_verify``.

Bars as for version 6: o <= 3e-3 relative (rounded to bf16), delta <= 1e-5 (the three-part bf16 split of S0
keeps the projections float32-accurate); every NaN-poisoned output element written; the state untouched.
Trees: random, chains (depth 31), stars, a single node, 32 nodes, node order unlike level order, several
requests of different sizes in one call, the full CUDA graphs' fixed-layout plans.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.plan import TreePlan

from _emulation import emulated, emulation_build_dir  # tests/cpu helper modules
from _gdn_emu_cases import _case, _depth_first, _g, _random_tree, _reference, _rel, _run_variant

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed for the CPU emulation")]

LIMIT = 227 * 1024


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    with emulated(emulation_build_dir(tmp_path_factory, "emu7")) as made:
        yield made


def _run7(c, plan, launches, options=(), return_delta=True, **kw):
    return _run_variant(c, plan, launches, 7, options, return_delta, **kw)


# (name, trees, h, hv, K, V, S7_BV, state index dtype)
CASES = [
    ("27b_heads_mixed_batch", [_random_tree(17, _g(1)), torch.arange(-1, 16), torch.tensor([-1]),
                               torch.tensor([-1] + [0] * 16)], 1, 3, 128, 32, 16, torch.int64),
    ("32_nodes_random_and_chain", [_random_tree(32, _g(2)), torch.arange(-1, 31)], 2, 6, 64, 16, 16, torch.int32),
    ("zoo_heads_bv32", [_random_tree(9, _g(3)), _random_tree(25, _g(4))], 2, 4, 64, 64, 32, torch.int64),
    ("group1_node_order_not_level_order", [_depth_first(10, 12), _random_tree(23, _g(5))], 1, 1, 32, 16, 16,
     torch.int32),
    ("group3_two_nodes_and_star", [torch.tensor([-1, 0]), torch.tensor([-1] + [0] * 20)], 1, 3, 32, 32, 32,
     torch.int64),
]


@pytest.mark.parametrize("name, trees, h, hv, kd, vd, bv, idx_dtype", CASES, ids=[c[0] for c in CASES])
def test_v7_matches_float64_reference(launches, name, trees, h, hv, kd, vd, bv, idx_dtype):
    c = _case(trees, h, hv, kd, vd, torch.bfloat16, seed=len(name), idx_dtype=idx_dtype)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    o_ref, d_ref = _reference(c)
    names, o7, d7 = _run7(c, plan, launches, (f"-DS7_BV={bv}",))
    assert names == ["gdn_tree_verify_small"]
    assert launches[0][1] == (vd // bv, h, len(trees))  # grid: V slices, q/k heads, requests
    assert _rel(o7, o_ref) <= 3e-3, _rel(o7, o_ref)
    assert _rel(d7, d_ref) <= 1e-5, _rel(d7, d_ref)
    _, o_only, _ = _run7(c, plan, launches, (f"-DS7_BV={bv}",), return_delta=False)  # no delta buffer: the same o
    assert torch.equal(o_only, o7)


def test_v7_block_v_16_and_32_agree(launches):
    # the columns per CTA change which warp holds a row of S0, not its arithmetic: identical outputs
    c = _case([_random_tree(30, _g(20)), torch.tensor([-1, 0, 0, 1])], 2, 6, 128, 64, torch.bfloat16, seed=21)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    _, o16, d16 = _run7(c, plan, launches, ("-DS7_BV=16",))
    _, o32, d32 = _run7(c, plan, launches, ("-DS7_BV=32",))
    assert torch.equal(o16, o32) and torch.equal(d16, d32)


def test_v7_without_l2norm_and_with_a_scale(launches):
    c = _case([_random_tree(21, _g(30))], 1, 2, 32, 16, torch.bfloat16, seed=31)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    o_ref, d_ref = _reference(c, scale=0.3, use_qk_l2norm=False)
    _, o7, d7 = _run7(c, plan, launches, scale=0.3, use_qk_l2norm=False)
    assert _rel(o7, o_ref) <= 3e-3 and _rel(d7, d_ref) <= 1e-5, (_rel(o7, o_ref), _rel(d7, d_ref))


def test_v7_on_fixed_layout_plans(launches):
    # full CUDA graphs: R trees of n nodes in the fixed layout (pair table padded to n (n + 1) / 2 a request)
    n = 17
    trees = [_random_tree(n, _g(40)), torch.arange(-1, n - 1), _depth_first(8, 8)]
    c = _case(trees, 1, 3, 64, 16, torch.bfloat16, seed=42)
    o_ref, d_ref = _reference(c)
    plan = TreePlan.build_into(torch.zeros(TreePlan.fixed_size(len(trees), n), dtype=torch.int32), c["parents"],
                               c["cu_nodes"], n, depth_bound=15)
    names, o7, d7 = _run7(c, plan, launches)
    assert names == ["gdn_tree_verify_small"]
    assert _rel(o7, o_ref) <= 3e-3 and _rel(d7, d_ref) <= 1e-5, (_rel(o7, o_ref), _rel(d7, d_ref))


def test_v7_runs_version_6_where_it_does_not_apply(launches, monkeypatch):
    # a tree of 33 nodes runs version 6 with the same outputs as asking for version 6
    c = _case([_random_tree(33, _g(50)), torch.tensor([-1])], 1, 3, 32, 16, torch.bfloat16, seed=51)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    assert "a tree of 33 nodes: version 7 takes at most 32" == kgdn.small_unsupported_reason(
        plan, torch.bfloat16, 1, 3, 32, 16, LIMIT)
    names, o7, d7 = _run7(c, plan, launches)
    assert names == ["gdn_tree_verify_grouped"]
    launches.clear()
    made, o6, d6 = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                        c["state_indices"], return_delta=True, variant=6)
    for _, fn in made:
        fn()
    assert torch.equal(o7, o6) and torch.equal(d7, d6)
    # float32 inputs: version 6 and then version 3 (two kernels)
    c32 = _case([_random_tree(12, _g(52))], 1, 3, 32, 16, torch.float32, seed=53)
    plan32 = TreePlan.build(c32["parents"], c32["cu_nodes"])
    names, _, _ = _run7(c32, plan32, launches)
    assert names == ["gdn_tree_pairs", "gdn_tree_verify_main"]


def test_v7_support_and_shared_memory():
    small = TreePlan.build(torch.tensor([-1, 0, 0]), torch.tensor([0, 3]))
    assert kgdn.small_unsupported_reason(small, torch.bfloat16, 16, 48, 128, 128, LIMIT) is None
    assert "float16" in kgdn.small_unsupported_reason(small, torch.float16, 16, 48, 128, 128, LIMIT)
    assert "not a multiple of 32" in kgdn.small_unsupported_reason(small, torch.bfloat16, 16, 48, 128, 48, LIMIT, 32)
    assert "not a multiple of 32" in kgdn.small_unsupported_reason(small, torch.bfloat16, 16, 48, 48, 128, LIMIT)
    assert "at most 256" in kgdn.small_unsupported_reason(small, torch.bfloat16, 1, 16, 128, 128, LIMIT, 32)
    # the 27B layer: under 48 KB at 16 columns (four CTAs per 228 KB SM), the q/k rows region reused at 32
    assert kgdn.small_smem_bytes(128, 3, 16) == 4 * (32 * 136 + 2 * 3 * 1040 + 768 + 13 * 32) <= 48 * 1024
    assert kgdn.small_smem_bytes(128, 3, 32) - kgdn.small_smem_bytes(128, 3, 16) == 4 * (2 * 3 * 32 * 36 - 32 * 136 + 768)
    need = kgdn.small_smem_bytes(128, 3, 16)
    assert kgdn.small_unsupported_reason(small, torch.bfloat16, 16, 48, 128, 128, need) is None
    assert "needs" in kgdn.small_unsupported_reason(small, torch.bfloat16, 16, 48, 128, 128, need - 4)

"""Verify kernel version 3 (projections on tensor cores, 3xTF32) through the CPU emulation
(cuda/host_emu: mma.sync m16n8k8 tf32 and cvt.rna.tf32 from the PTX ISA), against the float64
reference ``vllm_tfm.verify.gdn.gdn_tree_verify``. Four compiled configurations (float32 K = V = 32
at BV = 16, float32 K = V = 128 at BV = 64, bfloat16 K = V = 128 at BV = 32, float16 K = 64, V = 32
at BV = 16) keep the emulation builds few; versions 1 and 2 run through the emulation in
tests/cpu/test_kernel_loader.py.

Bars: float32 inputs o and delta <= 1e-5 relative (norm-wise), 16-bit inputs o <= 3e-3 (the output
is rounded to 16 bits), delta <= 1e-5; every NaN-poisoned output element written; state untouched.
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

from _gdn_emu_cases import _case, _deep_tree, _g, _random_tree, _rel  # tests/cpu helper module

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed for the CPU emulation")]


# (name, trees, h, hv, K, V, dtype, block_v, state index dtype)
CASES = [
    ("random_chain_root_star_fp32", [_random_tree(70, _g(1)), torch.arange(-1, 9), torch.tensor([-1]),
                                     torch.tensor([-1] + [0] * 11)], 1, 2, 32, 32, torch.float32, 16, torch.int64),
    ("single_node_fp32", [torch.tensor([-1])], 1, 2, 32, 32, torch.float32, 16, torch.int32),
    ("chain40_star33_fp32", [torch.arange(-1, 39), torch.tensor([-1] + [0] * 32)], 1, 2, 32, 32, torch.float32, 16,
     torch.int64),
    ("deep_depth35_fp32", [_deep_tree(45, _g(2))], 1, 1, 32, 32, torch.float32, 16, torch.int32),
    ("ragged_130_5_three_tiles_fp32", [_random_tree(130, _g(3)), _random_tree(5, _g(4))], 1, 1, 32, 32,
     torch.float32, 16, torch.int64),
    ("k128_v128_gqa_fp32", [_random_tree(40, _g(5)), torch.arange(-1, 6)], 2, 4, 128, 128, torch.float32, 64,
     torch.int32),
    ("k128_v128_bf16", [_random_tree(33, _g(6)), torch.tensor([-1])], 1, 2, 128, 128, torch.bfloat16, 32, torch.int64),
    ("k64_v32_f16_gqa", [_random_tree(20, _g(7)), torch.arange(-1, 4)], 2, 4, 64, 32, torch.float16, 16, torch.int32),
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    sys.path.insert(0, str(CUDA_DIR / "host_emu"))
    try:
        from emulate import emulated_kernels
    finally:
        sys.path.pop(0)
    try:
        with emulated_kernels(tmp_path_factory.mktemp("emu")):
            yield
    except subprocess.CalledProcessError as exc:  # a compiler without C++20 <barrier>
        pytest.skip(f"g++ could not build the emulation: {exc.stderr[:300]}")


def _run(c, plan, block_v, variant):
    before = c["ssm_state"].clone()
    o = torch.full(c["v"].shape, float("nan"), dtype=c["v"].dtype)
    d = torch.full(c["v"].shape, float("nan"))
    kgdn.gdn_tree_verify_planned(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"], c["state_indices"],
                                 return_delta=True, block_v=block_v, out=o, delta_out=d, variant=variant)
    assert not o.isnan().any() and not d.isnan().any(), "outputs left unwritten"
    assert torch.equal(c["ssm_state"], before), "the verify wrote the state"
    return o, d


@pytest.mark.parametrize("name, trees, h, hv, kd, vd, dtype, block_v, idx_dtype", CASES, ids=[c[0] for c in CASES])
def test_v3_matches_float64_reference(emulated, name, trees, h, hv, kd, vd, dtype, block_v, idx_dtype):
    c = _case(trees, h, hv, kd, vd, dtype, seed=len(name), idx_dtype=idx_dtype)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    o3, d3 = _run(c, plan, block_v, 3)
    tol_o = 1e-5 if dtype == torch.float32 else 3e-3
    assert _rel(o3, o_ref) <= tol_o, _rel(o3, o_ref)
    assert _rel(d3, d_ref) <= 1e-5, _rel(d3, d_ref)


def test_v3_uses_the_tf32_split_not_plain_tf32(emulated):
    # plain tf32 (one mma on rounded operands) would miss the float32 bar by ~100x on these inputs;
    # a 3xTF32 kernel meets it with room: the error must be far below tf32's 2^-11
    c = _case([_random_tree(64, _g(9))], 1, 1, 128, 128, torch.float32, seed=3)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    o3, d3 = _run(c, plan, 64, 3)
    assert _rel(o3, o_ref) <= 2e-6 and _rel(d3, d_ref) <= 2e-6


# Version 4 (16-bit q/k: each projection tile's rows staged whole by cp.async): the same mma
# operands in the same order as version 3, so its outputs equal version 3's bit for bit, and it
# meets the float64 bars; several tiles with a ragged last one, depth > 32, chains, stars, n = 1.
V4_CASES = [
    ("k128_v128_bf16_ragged_three_tiles", [_random_tree(130, _g(11)), _random_tree(5, _g(12))], 1, 2, 128, 128,
     torch.bfloat16, 32, torch.int64),
    ("k64_v32_f16_gqa_deep_chain_star", [_deep_tree(45, _g(13)), torch.arange(-1, 70), torch.tensor([-1] + [0] * 20)],
     2, 4, 64, 32, torch.float16, 16, torch.int32),
    ("k32_v32_bf16_single_and_random", [torch.tensor([-1]), _random_tree(66, _g(14))], 1, 1, 32, 32, torch.bfloat16,
     16, torch.int64),
    ("k32_v32_fp32_runs_version_3", [_random_tree(70, _g(15))], 1, 2, 32, 32, torch.float32, 16, torch.int64),
]


@pytest.mark.parametrize("name, trees, h, hv, kd, vd, dtype, block_v, idx_dtype", V4_CASES, ids=[c[0] for c in V4_CASES])
def test_v4_and_v5_equal_v3_and_match_float64_reference(emulated, name, trees, h, hv, kd, vd, dtype, block_v, idx_dtype):
    c = _case(trees, h, hv, kd, vd, dtype, seed=len(name) + 100, idx_dtype=idx_dtype)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    o4, d4 = _run(c, plan, block_v, 4)
    o3, d3 = _run(c, plan, block_v, 3)
    tol_o = 1e-5 if dtype == torch.float32 else 3e-3
    assert _rel(o4, o_ref) <= tol_o, _rel(o4, o_ref)
    assert _rel(d4, d_ref) <= 1e-5, _rel(d4, d_ref)
    assert torch.equal(o4, o3) and torch.equal(d4, d3), "version 4 must compute version 3's products in its order"
    o5, d5 = _run(c, plan, block_v, 5)  # version 5: version 3's arithmetic, the pairs' outputs read later
    assert torch.equal(o5, o3) and torch.equal(d5, d3)


def test_v4_shared_memory_is_the_whole_tile_for_16_bit_inputs_only():
    # mirrors gdn_verify_smem_words: two [64][K + 8] 16-bit buffers instead of two [64][32 + 4] float32 ones
    v3 = kgdn.verify_smem_bytes(128, 32, 33, 561, variant=3, qk_dtype=torch.bfloat16)
    v4 = kgdn.verify_smem_bytes(128, 32, 33, 561, variant=4, qk_dtype=torch.bfloat16)
    assert v4 - v3 == 4 * 2 * (64 * 136 // 2 - 64 * 36)
    assert kgdn.verify_smem_bytes(128, 32, 33, 561, variant=4, qk_dtype=torch.float32) == v3
    assert kgdn.verify_smem_bytes(128, 32, 33, 561, variant=4, qk_dtype=torch.float16) == v4
    assert kgdn.verify_smem_bytes(128, 32, 33, 561, variant=5, qk_dtype=torch.bfloat16) == v3  # version 3's layout
    # at K = 32 the whole 16-bit tile is smaller than version 3's float32 chunk: the mirror must not mix them up
    assert kgdn.verify_smem_bytes(32, 16, 67, 400, variant=4, qk_dtype=torch.bfloat16) < \
        kgdn.verify_smem_bytes(32, 16, 67, 400, variant=5, qk_dtype=torch.bfloat16)

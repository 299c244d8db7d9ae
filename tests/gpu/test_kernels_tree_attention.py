"""GPU tests: the tree attention kernel against the float64 torch reference on fresh random inputs.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_kernels_tree_attention.py -q``. Skipped
without a CUDA device or when the kernels cannot be compiled (no cuda-python / NVRTC).

Tolerances (norm-wise relative error over the tree rows against a float64 reference on the same
inputs): float32 1e-5; bfloat16 / float16 3e-3 (P is rounded to 16 bits before P V on the tensor
cores, and the output itself is rounded). Outputs are poisoned with NaN: every tree row must be
written, every other row left alone.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from tree_attention import make_case, plan_of, reference64, tree_parents, tree_rows  # noqa: E402

from vllm_tfm.kernels import tree_attention as kta  # noqa: E402
from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-3, torch.float16: 3e-3}


@pytest.fixture(scope="module", autouse=True)
def _kernels_must_work():
    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def run_poisoned(case: dict, **kw) -> torch.Tensor:
    """Planned kernel call into a NaN-filled output; checks which rows were written."""
    out = torch.full_like(case["q"], float("nan"))
    plan = plan_of(case)
    kta.tree_attention_planned(plan, case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                               case["seq_lens"], case["scale"], out, int(case["seq_lens"].max()), **kw)
    torch.cuda.synchronize()
    rows = tree_rows(case)
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert not out[rows].isnan().any(), "tree rows left unwritten"
    assert out[others.to(out.device)].isnan().all(), "rows of other requests were written"
    return out


def check(case: dict, **kw) -> float:
    out = run_poisoned(case, **kw)
    rows = tree_rows(case)
    err = rel(out[rows], reference64(case)[rows])
    assert err <= TOL[case["q"].dtype], err
    return err


MIXED = [("ddtree", 40), ("chain", 17), ("star", 33), ("deep", 65), ("random", 1), ("random", 23)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq, hkv, dim", [(24, 4, 256), (8, 8, 128), (16, 4, 64), (12, 2, 96)])
def test_mixed_batch_matches_float64_reference(dtype, hq, hkv, dim):
    # GQA 6 (the 27B shape), 1, 4, 6; n = 1, chains, stars, a deep 65-node tree, n not a tile
    # multiple; contexts 0, 1, short, 1000
    trees = [tree_parents(kind, n, seed=k) for k, (kind, n) in enumerate(MIXED)]
    case = make_case(trees, [0, 1, 130, 1000, 7, 64], hq, hkv, dim, block_size=16, dtype=dtype, seed=dim)
    check(case)


@pytest.mark.parametrize("block_size", [16, 32, 64, 80, 112, 1104])
def test_block_sizes(block_size):
    # 80 / 112: hybrid-model block sizes (multiples of 16, not powers of two); 1104: the 27B target's
    trees = [tree_parents("ddtree", 65, 1), tree_parents("random", 12, 2), [-1]]
    for dtype in (torch.bfloat16, torch.float32):
        check(make_case(trees, [500, 33, 2000], block_size=block_size, dtype=dtype, seed=block_size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_and_every_split_count(dtype):
    trees = [tree_parents("ddtree", 65, 3), tree_parents("deep", 33, 4), tree_parents("chain", 5, 5)]
    case = make_case(trees, [4096, 0, 4000], dtype=dtype, block_size=32, seed=11)
    errs = [check(case, splits=s) for s in (1, 2, 5, kta.MAX_SPLITS)]
    errs.append(check(case))  # automatic
    assert max(errs) <= TOL[dtype]


@pytest.mark.parametrize("block_size", [16, 1104])
def test_deeper_pipelines_give_the_same_outputs_bit_for_bit(block_size):
    # 3 and 4 key tiles in flight move copies only: the same sums in the same order as 2
    trees = [tree_parents("ddtree", 17, 21), tree_parents("ddtree", 17, 22), tree_parents("chain", 9, 23)]
    case = make_case(trees, [4000, 300, 31], block_size=block_size, seed=21)
    for splits in (1, 4, kta.MAX_SPLITS):
        outs = [run_poisoned(case, splits=splits, stages=st) for st in (2, 3, 4)]
        for o in outs[1:]:
            assert torch.equal(o.isnan(), outs[0].isnan()) and torch.equal(o.nan_to_num(0.0), outs[0].nan_to_num(0.0))
    check(case, stages=4)


def test_wide_trees_several_bitmask_words():
    trees = [tree_parents("ddtree", 129, 6), tree_parents("random", 128, 7), tree_parents("deep", 200, 8)]
    case = make_case(trees, [300, 64, 0], dtype=torch.bfloat16, block_size=16, seed=12)
    assert case["ancestor_bits"].shape[1] == 4
    check(case)
    check(dict(case, q=case["q"].float(), key_cache=case["key_cache"].float(), value_cache=case["value_cache"].float()))


def test_strided_query_and_output_like_vllm():
    """q a view of a fused projection (row stride > Hq * D), out a view of a wider buffer."""
    trees = [tree_parents("ddtree", 33, 9), tree_parents("star", 9, 10)]
    case = make_case(trees, [200, 50], seed=13)
    t, hq, dim = case["q"].shape
    fused = torch.randn(t, hq * dim + 2 * 4 * dim, device="cuda").to(case["q"].dtype)
    fused[:, : hq * dim] = case["q"].reshape(t, -1)
    case = dict(case, q=fused[:, : hq * dim].view(t, hq, dim))
    assert kta.tree_attention_unsupported(case["q"], case["key_cache"], case["value_cache"]) is None
    wide = torch.full((t, hq, dim + 64), float("nan"), device="cuda", dtype=case["q"].dtype)
    out = wide[..., :dim]
    plan = plan_of(case)
    kta.tree_attention_planned(plan, case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                               case["seq_lens"], case["scale"], out, int(case["seq_lens"].max()))
    rows = tree_rows(case)
    assert rel(out[rows], reference64(case)[rows]) <= TOL[case["q"].dtype]
    assert wide[..., dim:].isnan().all()


def test_repeated_split_calls_are_identical():
    trees = [tree_parents("ddtree", 65, 14)]
    case = make_case(trees, [3000], block_size=64, seed=14)
    a = run_poisoned(case, splits=7)
    b = run_poisoned(case, splits=7)
    # rows outside the trees keep their NaN poison (NaN != NaN): compare the poison pattern and the rest bitwise
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_public_wrapper_takes_the_kernel_silently_and_falls_back_with_a_warning():
    trees = [tree_parents("ddtree", 20, 15), tree_parents("chain", 4, 16)]
    case = make_case(trees, [77, 5], seed=15)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kta.tree_attention(**case)
    rows = tree_rows(case)
    assert rel(got[rows], reference64(case)[rows]) <= TOL[torch.bfloat16]
    odd = make_case(trees, [77, 5], hq=4, hkv=2, dim=80, seed=16)  # head size 80: not a multiple of 32
    with pytest.warns(RuntimeWarning, match="head size 80"):
        got = kta.tree_attention(**odd)
    assert rel(got[tree_rows(odd)], reference64(odd)[tree_rows(odd)]) <= TOL[torch.bfloat16]


def test_runtime_kernel_path_agrees_with_the_per_request_triton_path(monkeypatch):
    """runtime/attention.py: the one-launch path and the per-request unified_attention fallback."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "kernel")  # the opt-in (attention.DEFAULT_TREE_ATTENTION)
    from types import SimpleNamespace

    from tree_attention import _vllm_impl, kv_cache_of
    from vllm_tfm.vllm_plugin.runtime.attention import kernel_tree_attention, masked_tree_attention
    from vllm_tfm.vllm_plugin.runtime.inputs import per_request_trees

    trees = [tree_parents("ddtree", 65, 17), tree_parents("random", 30, 18), tree_parents("chain", 9, 19)]
    case = make_case(trees, [1500, 0, 40], block_size=16, seed=17)
    impl, layer = _vllm_impl(case)
    plan = plan_of(case)
    md = SimpleNamespace(seq_lens=case["seq_lens"], block_table=case["block_table"],
                         max_seq_len=int(case["seq_lens"].max()))
    kv = kv_cache_of(case)
    ours = torch.full_like(case["q"], float("nan"))
    assert kernel_tree_attention(impl, case["q"], kv, md, ours, SimpleNamespace(attn_plan=plan))
    # as in a CUDA graph captured at a long engine bound (its splits stay within one merge chunk): the same rows
    bounded = torch.full_like(case["q"], float("nan"))
    assert kernel_tree_attention(impl, case["q"], kv, md, bounded, SimpleNamespace(attn_plan=plan, attn_max_seq_len=1 << 18))
    loop = torch.full_like(case["q"], float("nan"))
    masked_tree_attention(impl, layer, case["q"], kv, md, loop, per_request_trees(plan, "cuda"))
    torch.cuda.synchronize()
    rows = tree_rows(case)
    want = reference64(case)[rows]
    assert rel(ours[rows], want) <= TOL[torch.bfloat16]
    assert rel(loop[rows], want) <= 1e-2  # vLLM's Triton kernel (bf16 P, its own accumulation order)
    assert rel(ours[rows], loop[rows]) <= 1e-2
    assert rel(bounded[rows], want) <= TOL[torch.bfloat16]

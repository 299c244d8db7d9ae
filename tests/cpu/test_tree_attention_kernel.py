"""The tree attention kernel (``cuda/tree_attention.cu``) on the CPU through the CUDA emulation
(``cuda/host_emu``), against the torch reference (``vllm_tfm.verify.tree_attention``): every key-split
count, so that the merge of the splits' partials runs with rows past the trees' (a row tile of 64 rows
holding 34), empty splits (more splits than key tiles) and one split only; blocks smaller than a key
tile (a block-table lookup per row) and larger (a tile's two blocks located once, tiles crossing a
block's end); 2, 3 and 4 tiles in flight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _emulation import emulated, emulation_build_dir

from vllm_tfm.kernels import tree_attention as kta
from vllm_tfm.tree.bitmask import ragged_ancestor_bits
from vllm_tfm.verify import tree_attention as ref


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_tree_attn")


def _case(dtype: torch.dtype, seed: int = 0, bs: int = 16):
    g = torch.Generator().manual_seed(seed)
    parents = [np.array([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 17)]),
               np.array([-1]), np.arange(-1, 8)]
    ctx = [150, 0, 40]
    hq, hkv, d, nblocks = 4, 2, 64, 48
    size = np.array([len(p) for p in parents])
    start = np.concatenate([[0], np.cumsum(size)[:-1]])
    t = int(size.sum())
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    kc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=g).to(dtype)
    seq = torch.tensor([c + n for c, n in zip(ctx, size)], dtype=torch.int32)
    perm = torch.randperm(nblocks, generator=g)
    bt = perm[: 3 * 12].view(3, 12).to(torch.int32)
    flat = np.concatenate(parents)
    cu = np.concatenate([[0], np.cumsum(size)])
    bits = torch.from_numpy(ragged_ancestor_bits(flat, cu))
    req = np.arange(3)
    plan = kta.TreeAttentionPlan.from_parents(req, start, size, flat, "cpu")
    args = dict(q=q, key_cache=kc, value_cache=vc, block_table=bt, seq_lens=seq, tree_req=torch.from_numpy(req),
                tree_start=torch.from_numpy(start), tree_size=torch.from_numpy(size), ancestor_bits=bits, scale=0.125)
    return plan, args, int(seq.max())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_every_split_count_matches_the_reference(emu_dir: Path, dtype, tol) -> None:
    plan, a, max_len = _case(dtype)
    a64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in a.items()}
    want = ref.tree_attention(**a64)
    outs = {}
    with emulated(emu_dir) as launches:
        for splits in (1, 2, 3, 5, 16, 40):  # 40: the merge's second and third chunks of 16, empty splits
            out = torch.full_like(a["q"], float("nan"))
            kta.tree_attention_planned(plan, a["q"], a["key_cache"], a["value_cache"], a["block_table"], a["seq_lens"],
                                       a["scale"], out, max_len, splits=splits)
            outs[splits] = out
    # one launch with one split; with more, the split kernel then the merge
    # (more than 16 splits: the merge's chunked entry point)
    assert [n for n, *_ in launches] == (["tree_attention"] + ["tree_attention", "tree_attention_merge"] * 4
                                         + ["tree_attention", "tree_attention_merge_many"])
    for splits, out in outs.items():
        assert not out.isnan().any(), splits
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err <= tol, (splits, err)
    if dtype == torch.float32:  # the splits' merge changes only the float32 summation order
        for splits in (2, 3, 5, 16, 40):
            assert torch.allclose(outs[splits], outs[1], rtol=1e-5, atol=1e-6), splits


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_blocks_larger_than_a_tile_and_deeper_pipelines_match_the_reference_bit_for_bit_across_stages(
        emu_dir: Path, dtype, tol) -> None:
    # 80-key blocks hold a whole tile (32 or 64 keys): the kernel locates a tile's keys from its first
    # key and two block-table entries; tiles 2 (keys 64..127 at 64 per tile) and 4 (128..159, 32 per
    # tile) cross a block's end, and each request's last tile ends before its block does
    plan, a, max_len = _case(dtype, seed=3, bs=80)
    a64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in a.items()}
    want = ref.tree_attention(**a64)
    outs = {}
    with emulated(emu_dir) as launches:
        for stages in (2, 3, 4):
            for splits in (1, 3):
                out = torch.full_like(a["q"], float("nan"))
                kta.tree_attention_planned(plan, a["q"], a["key_cache"], a["value_cache"], a["block_table"],
                                           a["seq_lens"], a["scale"], out, max_len, splits=splits, stages=stages)
                outs[stages, splits] = out
    assert [n for n, *_ in launches] == ["tree_attention", "tree_attention", "tree_attention_merge"] * 3
    for key, out in outs.items():
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert err <= tol, (key, err)
    for splits in (1, 3):  # the pipeline's depth moves copies, not arithmetic
        assert torch.equal(outs[3, splits], outs[2, splits]) and torch.equal(outs[4, splits], outs[2, splits])
    with pytest.raises(ValueError, match="stages=5 must be 2, 3 or 4"):
        kta.tree_attention_planned(plan, a["q"], a["key_cache"], a["value_cache"], a["block_table"], a["seq_lens"],
                                   a["scale"], torch.zeros_like(a["q"]), max_len, stages=5)

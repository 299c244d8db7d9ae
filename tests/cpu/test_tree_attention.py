"""Tree attention over a paged KV cache: the torch reference against a dense computation written
here, the vectorised ancestor bitmasks against walking parents, argument errors, the kernel's host
plan, and the CUDA kernel itself run on the CPU through cuda/host_emu against the reference."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _trees import path_of, ragged, random_tree_parents

from vllm_tfm.kernels import tree_attention as kta
from vllm_tfm.tree.bitmask import ragged_ancestor_bits
from vllm_tfm.tree.types import ancestor_mask, pack_bitmask
from vllm_tfm.verify import tree_attention as ref

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"


def make_case(parent_list, ctxs, hq=4, hkv=2, dim=16, block_size=16, dtype=torch.float64, seed=0):
    """A batch in vLLM's layout: a paged cache [blocks, H, block, 2D] whose blocks are handed out in
    random order, trees at scattered query rows (other rows belong to other requests), requests in
    an order different from the trees'. Also returns each request's dense K/V [kv_len, Hkv, D]."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(p.numel()) for p in parent_list]
    lens = [c + n for c, n in zip(ctxs, sizes)]
    num_req = len(sizes) + 1  # one request without a tree
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = num_req * max_blocks + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = perm[: num_req * max_blocks].view(num_req, max_blocks).to(torch.int32)
    kv = torch.randn(num_blocks, hkv, block_size, 2 * dim, generator=gen, dtype=torch.float64)
    req_of_tree = torch.randperm(num_req, generator=gen)[: len(sizes)]
    seq_lens = torch.full((num_req,), 3, dtype=torch.int32)
    dense = []
    for t, r in enumerate(req_of_tree.tolist()):
        seq_lens[r] = lens[t]
        k = torch.randn(lens[t], hkv, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(lens[t], hkv, dim, generator=gen, dtype=torch.float64)
        for p in range(lens[t]):  # scatter into the pages: block_table[r, p // bs], slot p % bs
            blk, slot = int(block_table[r, p // block_size]), p % block_size
            kv[blk, :, slot, :dim] = k[p]
            kv[blk, :, slot, dim:] = v[p]
        dense.append((k, v))
    starts, row = [], 2
    for n in sizes:
        starts.append(row)
        row += n + 3
    q = torch.randn(row + 2, hq, dim, generator=gen, dtype=torch.float64)
    parents, cu = ragged(parent_list)
    bits = torch.from_numpy(ragged_ancestor_bits(parents.numpy(), cu.numpy()))
    kv = kv.to(dtype)
    key_cache, value_cache = kv.transpose(1, 2).split(dim, dim=-1)  # as runtime/attention.py does
    args = {"q": q.to(dtype), "key_cache": key_cache, "value_cache": value_cache, "block_table": block_table,
            "seq_lens": seq_lens, "tree_req": req_of_tree, "tree_start": torch.tensor(starts),
            "tree_size": torch.tensor(sizes), "ancestor_bits": bits, "scale": dim**-0.5}
    return args, dense


def dense_tree_attention(args, dense, parent_list, ctxs):
    """Per node and query head: softmax over the context and the node's root..node path."""
    q = args["q"].double()
    hq, hkv = q.shape[1], args["key_cache"].shape[2]
    out = {}
    for t, par in enumerate(parent_list):
        k, v = dense[t]
        ctx, s = ctxs[t], int(args["tree_start"][t])
        for j in range(par.numel()):
            keys = list(range(ctx)) + [ctx + i for i in path_of(par, j)]
            for h in range(hq):
                kh = h * hkv // hq  # GQA: consecutive query heads share a KV head
                w = torch.softmax(k[keys, kh] @ q[s + j, h] * args["scale"], dim=0)
                out[(s + j, h)] = w @ v[keys, kh]
    return out


TREES = [
    lambda g: random_tree_parents(9, g, "random"),
    lambda g: random_tree_parents(6, g, "chain"),
    lambda g: torch.tensor([-1]),
    lambda g: random_tree_parents(7, g, "star"),
    lambda g: random_tree_parents(70, g, "deep"),  # two bitmask words
]


@pytest.mark.parametrize("hq, hkv, block_size", [(4, 2, 16), (3, 3, 32), (6, 1, 48)])
def test_reference_matches_dense_attention(hq, hkv, block_size):
    gen = torch.Generator().manual_seed(hq * 7 + block_size)
    parent_list = [f(gen) for f in TREES]
    ctxs = [23, 0, 40, 1, 17]
    args, dense = make_case(parent_list, ctxs, hq=hq, hkv=hkv, block_size=block_size, seed=hq)
    out = torch.full_like(args["q"], 7.0)
    got = ref.tree_attention(**args, out=out)
    assert got is out
    want = dense_tree_attention(args, dense, parent_list, ctxs)
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    for (row, h), w in want.items():
        assert torch.allclose(got[row, h], w, rtol=0, atol=1e-12), (row, h)
        written[row] = True
    assert torch.all(got[~written] == 7.0)  # rows of other requests untouched
    # float32 inputs are computed in float32
    args32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
    got32 = ref.tree_attention(**args32)
    assert got32.dtype == torch.float32
    rows = torch.tensor(sorted({r for r, _ in want}))
    assert torch.allclose(got32[rows].double(), got[rows], atol=2e-5)


def test_ragged_bits_match_walking_parents():
    gen = torch.Generator().manual_seed(4)
    parent_list = [random_tree_parents(130, gen, "random"), random_tree_parents(70, gen, "chain"),
                   torch.tensor([-1]), random_tree_parents(65, gen, "deep"), random_tree_parents(64, gen, "star")]
    parents, cu = ragged(parent_list)
    bits = ragged_ancestor_bits(parents.numpy(), cu.numpy())
    assert bits.dtype == np.int64 and bits.shape == (parents.numel(), 3)
    row = 0
    for par in parent_list:
        for j in range(par.numel()):
            anc = set(path_of(par, j))
            for i in range(3 * 64):
                bit = (int(bits[row, i // 64]) >> (i % 64)) & 1
                assert bit == (i in anc), (row, i)
            row += 1
    # and against the single-tree packer (its own construction)
    single = ragged_ancestor_bits(parent_list[0].numpy(), np.array([0, 130]))
    assert np.array_equal(single, pack_bitmask(ancestor_mask(parent_list[0])).numpy())
    wide = ragged_ancestor_bits(parent_list[2].numpy(), np.array([0, 1]), words=2)
    assert wide.tolist() == [[1, 0]]


@pytest.mark.parametrize(
    "parents, cu, words, message",
    [
        ([-1, 0, 2], [0, 3], None, r"parents\[2\] = 2 is invalid for local node 2"),
        ([0, 0], [0, 2], None, r"parents\[0\] = 0 is invalid"),
        ([-1, 0], [0, 1], None, "must start at 0 and end at the number of nodes 2"),
        ([-1, -1], [0, 2, 2], None, "tree 1 has 0 nodes"),
        ([-1] + list(range(64)), [0, 65], 1, "1 words per row cannot hold a tree of 65 nodes"),
    ],
)
def test_ragged_bits_reject_malformed_batches(parents, cu, words, message):
    with pytest.raises(ValueError, match=message):
        ragged_ancestor_bits(np.array(parents), np.array(cu), words)


def _small_case():
    gen = torch.Generator().manual_seed(1)
    return make_case([random_tree_parents(5, gen, "random"), torch.tensor([-1, 0])], [20, 0], block_size=16)[0]


def _set_bit(bits, row, i, on):
    b = bits.clone()
    w = int(b[row, i // 64])
    w = w | (1 << (i % 64)) if on else w & ~(1 << (i % 64))
    b[row, i // 64] = w - (1 << 64) if w >= 1 << 63 else w
    return b


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {"q": a["q"][:, :3]}, r"Hq=3 query heads must be a multiple of Hkv=2"),
        (lambda a: {"q": a["q"].float()}, "must share one floating dtype"),
        (lambda a: {"key_cache": a["key_cache"][..., :8], "value_cache": a["value_cache"][..., :8]},
         r"head size 8 differs from q's 16"),
        (lambda a: {"seq_lens": a["seq_lens"].index_fill(0, a["tree_req"][:1], 3)}, r"seq_lens\[\d\] = 3 is shorter than the tree's 5 nodes"),
        (lambda a: {"block_table": a["block_table"][:, :1]}, r"need \d blocks; block_table has 1 columns"),
        (lambda a: {"block_table": a["block_table"].clone().fill_(99)}, "names a block outside the cache"),
        (lambda a: {"tree_start": torch.tensor([0, a["q"].shape[0] - 1])}, r"tree 1: rows \d+ \.\. \d+ are outside q's"),
        (lambda a: {"tree_start": torch.tensor([2, 4])}, "trees overlap"),
        (lambda a: {"tree_req": torch.tensor([int(a["tree_req"][0]), 7])}, r"tree_req\[1\] = 7 is not a row of block_table"),
        (lambda a: {"tree_size": torch.tensor([5])}, r"tree_req must have shape \[1\]"),
        (lambda a: {"ancestor_bits": a["ancestor_bits"][:6]}, "has 6 rows for 7 tree nodes"),
        (lambda a: {"ancestor_bits": _set_bit(a["ancestor_bits"], 3, 3, False)}, r"row 3 \(tree 0, node 3\) does not see itself"),
        (lambda a: {"ancestor_bits": _set_bit(a["ancestor_bits"], 5, 1, True)}, r"row 5 \(tree 1, node 0\) sees a later node"),
        (lambda a: {"ancestor_bits": a["ancestor_bits"].int()}, "must be a .* int64 tensor"),
        (lambda a: {"out": torch.zeros(2, 4, 16, dtype=torch.float64)}, r"out must be a torch.float64 tensor of shape"),
    ],
)
def test_reference_rejects_bad_arguments(change, message):
    args = _small_case()
    args.update(change(args))
    with pytest.raises(ValueError, match=message):
        ref.tree_attention(**args)
    with pytest.raises(ValueError, match=message):  # the kernel wrapper runs the same checks first
        kta.tree_attention(**args)


def test_cpu_inputs_use_the_reference_without_warning():
    import warnings

    args = _small_case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kta.tree_attention(**args)
    assert torch.equal(got, ref.tree_attention(**args))
    assert kta.tree_attention_unsupported(args["q"], args["key_cache"], args["value_cache"]) == kta.NOT_CUDA


def test_plan_packs_meta_and_bits_in_one_buffer():
    parents, cu = ragged([torch.tensor([-1, 0, 0]), torch.tensor([-1]), torch.arange(-1, 69)])
    plan = kta.TreeAttentionPlan.from_parents(np.array([4, 0, 2]), np.array([10, 3, 20]), np.array([3, 1, 70]),
                                              parents.numpy(), "cpu")
    assert plan.meta.dtype == torch.int32 and plan.bits_dev.dtype == torch.int64
    assert plan.meta.tolist() == [4, 0, 2, 10, 3, 20, 3, 1, 70, 0, 3, 4]
    assert plan.bits_dev.shape == (74, 2) and plan.words == 2 and plan.max_nodes == 70
    assert torch.equal(plan.bits_dev, torch.from_numpy(ragged_ancestor_bits(parents.numpy(), cu.numpy())))
    assert plan.bits_dev.untyped_storage().data_ptr() == plan.meta.untyped_storage().data_ptr()  # one transfer
    with pytest.raises(ValueError, match=r"bits \[sum of sizes, words\]"):
        kta.TreeAttentionPlan.build(np.array([0]), np.array([0]), np.array([2]), np.zeros((3, 1)), "cpu")


def test_split_and_tile_choice():
    assert kta.choose_splits(896, 130, 132) == 1  # 32 requests x n=65 at the 27B shape: enough CTAs
    assert kta.choose_splits(28, 130, 132) == 9  # one request: split the keys, within one wave (252 of 264)
    assert kta.choose_splits(28, 6, 132) == 6  # short context: at least a tile per split
    assert kta.choose_splits(1, 10**6, 132) == kta.MAX_SPLITS
    assert kta.choose_splits(8, 17, 132) == 16  # one tree of 17 nodes at 512 keys, the 27B shape: one chunk of merge
    assert kta.choose_splits(8, 128, 132) == 16  # at 4096 keys (tiles of 32): more splits lost there (section 44)
    assert kta.choose_splits(8, 1024, 132) == 33  # at 32k keys: one wave of 264 CTAs, ~31 tiles each
    assert kta.choose_splits(8, 400, 132) == 25  # between: 16 tiles or more per split past 16 splits
    assert kta.choose_splits(8, 10**6, 132) == 33
    # a CUDA graph captured at the engine's max_model_len replays at every context: within one merge chunk
    assert kta.choose_splits(8, 1024, 132, long_splits=False) == kta.MERGE_CHUNK == 16
    assert kta.choose_splits(64, 1024, 132, long_splits=False) == 4  # below a chunk: the same as with long splits
    assert kta.choose_splits(132, 10**6, 132) == 1  # a wave of row tiles already: no split
    assert kta.choose_splits(64, 17, 132) == 4  # 8 such trees: 256 CTAs, one wave of two per SM (5 would spill)
    assert kta.choose_splits(64, 17, 132, ctas_per_sm=1) == 2
    assert kta.choose_block_n(256, torch.bfloat16) == 32 and kta.choose_block_n(128, torch.float16) == 64
    assert kta.choose_block_n(64, torch.float32) == 32
    # 27B shape, bf16: two CTAs per SM fit an H100/H200 (227 KB per block, 228 KB per SM)
    assert 2 * kta.tree_attention_smem_bytes(256, 32, torch.bfloat16) + 2 * 4160 <= 228 * 1024
    assert kta.tree_attention_smem_bytes(256, 32, torch.float32) <= 227 * 1024 - 4160


# ---------------------------------------------------------------------------------------------
# the kernel on the CPU (cuda/host_emu), behind the real wrapper


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed for the CPU emulation")
def test_kernel_under_cpu_emulation_matches_the_reference(tmp_path, monkeypatch):
    sys.path.insert(0, str(CUDA_DIR / "host_emu"))
    try:
        from emulate import emulated_kernels
    finally:
        sys.path.pop(0)
    gen = torch.Generator().manual_seed(7)
    # 70 nodes: two bitmask words; with G = 2, 140 rows = three row tiles (the last one 12 rows)
    parent_list = [random_tree_parents(70, gen, "deep"), torch.tensor([-1]), random_tree_parents(6, gen, "chain"),
                   random_tree_parents(11, gen, "random")]
    ctxs = [37, 0, 5, 130]
    cases = [  # dtype, hq, hkv, dim, block_size, splits, tolerance
        (torch.float32, 4, 2, 32, 16, 1, 1e-5),
        (torch.bfloat16, 4, 2, 32, 48, 3, 3e-3),
        (torch.float16, 3, 1, 64, 112, 1, 1e-3),
        (torch.float32, 2, 2, 32, 80, 5, 1e-5),
    ]
    # split partials of empty splits are never read: a NaN-poisoned workspace must not leak
    monkeypatch.setattr(kta, "_workspace", lambda numel, device: torch.full((numel,), float("nan"), device=device))
    try:
        with emulated_kernels(tmp_path / "emu") as launches:
            for dtype, hq, hkv, dim, bs, splits, tol in cases:
                args, _ = make_case(parent_list, ctxs, hq=hq, hkv=hkv, dim=dim, block_size=bs, dtype=dtype, seed=hq)
                want = ref.tree_attention(**{k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                                             for k, v in args.items()})
                chk = ref.check_tree_attention_args(**{k: v for k, v in args.items() if k != "scale"})
                plan = kta.TreeAttentionPlan.build(np.array(chk.req), np.array(chk.start), np.array(chk.size),
                                                   args["ancestor_bits"].numpy(), "cpu")
                out = torch.full_like(args["q"], float("nan"))
                kta.tree_attention_planned(plan, args["q"], args["key_cache"], args["value_cache"], args["block_table"],
                                           args["seq_lens"], args["scale"], out, max(chk.seq_len), splits=splits)
                rows = torch.cat([torch.arange(s, s + n) for s, n in zip(chk.start, chk.size)])
                others = torch.ones(out.shape[0], dtype=torch.bool)
                others[rows] = False
                assert not out[rows].isnan().any(), dtype
                assert out[others].isnan().all(), dtype  # only tree rows are written
                assert _rel(out[rows], want[rows]) < tol, (dtype, _rel(out[rows], want[rows]))
                split_launch = launches[-2] if splits > 1 else launches[-1]
                assert split_launch[0] == "tree_attention" and split_launch[1][1] == hkv * splits
                if splits > 1:  # the splits' merge: one more launch, a CTA per 128 x 4 outputs of each row tile
                    mtiles, _, trees = split_launch[1]
                    assert launches[-1][0] == "tree_attention_merge"
                    assert launches[-1][1] == (-(-kta.BLOCK_M * dim // (4 * kta.THREADS)), trees * hkv * mtiles, 1)
        # one launch per call with one split, two with more
        assert len(launches) == sum(1 + (c[5] > 1) for c in cases)
    except subprocess.CalledProcessError as exc:  # a compiler without C++20 <barrier>
        pytest.skip(f"g++ could not build the emulation: {exc.stderr[:300]}")


def test_ragged_depths_equal_walking_the_parents():
    from _trees import TREE_KINDS, random_tree_parents
    from vllm_tfm.tree.bitmask import ragged_depths

    g = torch.Generator().manual_seed(11)
    trees = [random_tree_parents(n, g, kind) for n in (1, 2, 17, 65, 200) for kind in TREE_KINDS]
    cu = np.concatenate([[0], np.cumsum([t.numel() for t in trees])])
    got = ragged_depths(torch.cat(trees).numpy(), cu)
    want = []
    for t in trees:
        for i in range(t.numel()):
            d, j = 0, i
            while int(t[j]) >= 0:
                j, d = int(t[j]), d + 1
            want.append(d)
    assert got.tolist() == want
    assert ragged_depths(np.array([-1, -1, 0, 1]), np.array([0, 1, 4])).tolist() == [0, 0, 1, 2]  # two trees
    with pytest.raises(ValueError, match="parent chain does not reach a root"):
        ragged_depths(np.array([-1, 2, 1]), np.array([0, 3]))


@pytest.mark.parametrize("sizes", [(33,), (33,) * 8, (1, 2, 64, 17, 5), (17,) * 30, (65, 3), (200,), (33,) * 16])
def test_ancestor_bits_and_depths_equal_the_whole_array_functions(sizes):
    # the one-pass loop (batches of <= SMALL_BATCH_NODES nodes in trees of <= 64) and the numpy fallback
    # (bigger batches, trees of more than 64 nodes) give ragged_ancestor_bits' and ragged_depths' arrays
    from _trees import TREE_KINDS, random_tree_parents
    from vllm_tfm.tree.bitmask import SMALL_BATCH_NODES, ancestor_bits_and_depths, ragged_depths

    g = torch.Generator().manual_seed(sum(sizes))
    trees = [random_tree_parents(n, g, TREE_KINDS[i % len(TREE_KINDS)]) for i, n in enumerate(sizes)]
    parents = torch.cat(trees).numpy()
    cu = np.concatenate([[0], np.cumsum(sizes)])
    bits, depths = ancestor_bits_and_depths(parents, cu)
    want_bits = ragged_ancestor_bits(parents, cu)
    assert bits.dtype == want_bits.dtype == np.int64 and np.array_equal(bits, want_bits)
    assert depths.dtype == np.int64 and np.array_equal(depths, ragged_depths(parents, cu))
    assert bits.shape == (sum(sizes), (max(sizes) + 63) // 64)
    assert (sum(sizes) <= SMALL_BATCH_NODES and max(sizes) <= 64) == (sizes in ((33,), (33,) * 8, (1, 2, 64, 17, 5),
                                                                                  (17,) * 30))  # both paths ran


@pytest.mark.parametrize(
    "parents, cu, message",
    [
        ([-1, 0, 2], [0, 3], r"parents\[2\] = 2 is invalid for local node 2"),
        ([0, 0], [0, 2], r"parents\[0\] = 0 is invalid for local node 0"),
        ([-1, 0, 0, -1, 3], [0, 3, 5], r"parents\[4\] = 3 is invalid for local node 1"),
        ([-1, 0, -1, 5], [0, 2, 4], r"parents\[3\] = 5 is invalid for local node 1"),
        ([-1, 0], [0, 1], "must start at 0 and end at the number of nodes 2"),
        ([-1, -1], [0, 2, 2], "tree 1 has 0 nodes"),
    ],
)
def test_ancestor_bits_and_depths_reject_what_ragged_bits_rejects(parents, cu, message):
    from vllm_tfm.tree.bitmask import ancestor_bits_and_depths

    for fn in (ancestor_bits_and_depths, ragged_ancestor_bits):  # the same first malformed entry, the same words
        with pytest.raises(ValueError, match=message):
            fn(np.array(parents), np.array(cu))

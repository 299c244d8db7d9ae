"""Tree causal conv1d and its commit (vllm_tfm.verify.conv) against per-path causal convolution.

The oracle follows vLLM's causal_conv1d_update semantics, written here with F.conv1d: the
sequence [committed columns s..s+W-2 (oldest first) | x along the path] is convolved depthwise
without padding (out[t] = sum_w weight[:, w] * seq[t + w], so weight[:, W-1] meets the newest input).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _trees import path_of, ragged, random_tree_parents
from vllm_tfm.verify.conv import tree_causal_conv1d, tree_conv_commit

F64 = torch.float64


def make_case(parent_list, dim=6, width=4, state_len=None, num_slots=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    parents, cu = ragged(parent_list)
    r = len(parent_list)
    num_slots = num_slots or r + 2
    return dict(
        x=torch.randn(parents.numel(), dim, generator=gen, dtype=F64),
        parents=parents,
        cu_nodes=cu,
        conv_state=torch.randn(num_slots, dim, state_len or width - 1, generator=gen, dtype=F64),
        state_indices=torch.randperm(num_slots, generator=gen)[:r],
        weight=torch.randn(dim, width, generator=gen, dtype=F64),
        bias=torch.randn(dim, generator=gen, dtype=F64),
    )


def conv(c, **kw):
    if "bias" not in kw:
        kw["bias"] = c["bias"]
    return tree_causal_conv1d(c["x"], c["parents"], c["cu_nodes"], c["conv_state"], c["state_indices"],
                              c["weight"], **kw)


def per_path_oracle(c, bias, activation="silu", window_start=None) -> torch.Tensor:
    width = c["weight"].shape[1]
    cu = c["cu_nodes"].tolist()
    out = torch.empty_like(c["x"])
    for r, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        slot = int(c["state_indices"][r])
        ws = 0 if window_start is None else int(window_start[r])
        committed = c["conv_state"][slot, :, ws : ws + width - 1]
        for i in range(e - s):
            p = torch.tensor(path_of(c["parents"][s:e], i)) + s
            seq = torch.cat([committed, c["x"][p].T], dim=1)  # [D, W-1 + path length]
            y = F.conv1d(seq[None], c["weight"][:, None, :], bias, groups=seq.shape[0])[0, :, -1]
            out[s + i] = F.silu(y) if activation == "silu" else y
    return out


def test_weight_orientation_by_hand():
    """W=4, D=1, weight [1, 10, 100, 1000], committed [1, 2, 3]: root x=5 gives 1*1+10*2+100*3+1000*5."""
    c = dict(x=torch.tensor([[5.0], [7.0], [9.0]], dtype=F64), parents=torch.tensor([-1, 0, 0]),
             cu_nodes=torch.tensor([0, 3]), conv_state=torch.tensor([[[1.0, 2.0, 3.0]]], dtype=F64),
             state_indices=torch.tensor([0]), weight=torch.tensor([[1.0, 10.0, 100.0, 1000.0]], dtype=F64))
    y = conv(c, bias=None, activation=None)
    # nodes 1 and 2 are siblings: each sees itself, the root and the two newest committed columns
    assert y[:, 0].tolist() == [5321.0, 2 + 30 + 500 + 7000, 2 + 30 + 500 + 9000]


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("kind", ["random", "star", "deep"])
def test_tree_conv_equals_per_path_conv(kind, width):
    parents = random_tree_parents(40, torch.Generator().manual_seed(width), kind)
    c = make_case([parents], width=width, seed=width)
    assert torch.allclose(conv(c), per_path_oracle(c, c["bias"]), rtol=1e-14, atol=1e-14)


def test_chain_equals_causal_conv_over_state_and_x():
    c = make_case([torch.arange(-1, 11)], dim=5, seed=1)
    slot = int(c["state_indices"][0])
    seq = torch.cat([c["conv_state"][slot], c["x"].T], dim=1)[None]  # [1, D, W-1 + n]
    want = F.silu(F.conv1d(seq, c["weight"][:, None, :], c["bias"], groups=5)[0].T)
    assert torch.allclose(conv(c), want, rtol=1e-14, atol=1e-14)


def test_ragged_batch_window_start_and_state_untouched():
    gen = torch.Generator().manual_seed(4)
    trees = [random_tree_parents(15, gen, "random"), torch.tensor([-1]), random_tree_parents(20, gen, "deep"),
             random_tree_parents(7, gen, "star")]
    c = make_case(trees, width=4, state_len=9, num_slots=5, seed=4)
    c["state_indices"] = torch.tensor([3, 0, 3, 4])  # slot 3 shared
    window_start = torch.tensor([0, 6, 2, 5])  # 6 + W-1 == L: the last possible offset
    before = c["conv_state"].clone()
    y = conv(c, window_start=window_start)
    assert torch.equal(c["conv_state"], before)  # verify never writes the conv state
    assert torch.allclose(y, per_path_oracle(c, c["bias"], window_start=window_start), rtol=1e-14, atol=1e-14)


def test_prompt_shorter_than_window_uses_zero_state():
    """A fresh request (zero conv state) equals a causal conv of the path alone, zero-padded on the left."""
    parents = random_tree_parents(12, torch.Generator().manual_seed(9), "random")
    c = make_case([parents], seed=9)
    c["conv_state"].zero_()
    y = conv(c, bias=None, activation=None)
    for i in range(12):
        path = path_of(parents, i)
        if len(path) >= 4:
            continue
        seq = c["x"][path].T[None]
        want = F.conv1d(seq, c["weight"][:, None, :], None, padding=3, groups=6)[0, :, len(path) - 1]
        assert torch.allclose(y[i], want, rtol=1e-14, atol=1e-14)


def test_bias_none_and_activation_none():
    parents = random_tree_parents(25, torch.Generator().manual_seed(2), "random")
    c = make_case([parents], seed=2)
    assert torch.allclose(conv(c, bias=None, activation=None), per_path_oracle(c, None, activation=None),
                          rtol=1e-14, atol=1e-14)
    assert torch.allclose(conv(c, bias=None), per_path_oracle(c, None), rtol=1e-14, atol=1e-14)


def test_output_dtype_follows_x_with_fp32_math():
    parents = random_tree_parents(10, torch.Generator().manual_seed(3), "random")
    c = make_case([parents], seed=3)
    cb = dict(c, x=c["x"].bfloat16(), conv_state=c["conv_state"].bfloat16(), weight=c["weight"].float(),
              bias=c["bias"].float())
    y = conv(cb)
    assert y.dtype == torch.bfloat16
    exact = dict(cb, x=cb["x"].double(), conv_state=cb["conv_state"].double(), weight=cb["weight"].double())
    ref = per_path_oracle(exact, cb["bias"].double())
    assert torch.allclose(y.double(), ref, rtol=2.0**-8, atol=1e-6)  # one bf16 rounding of the output


# ---------------------------------------------------------------------------------------------
# commit


@pytest.mark.parametrize("width", [2, 4])
def test_commit_windows(width):
    """accepted 0, a deep node and a path shorter than W-1; swapped slots, column offsets."""
    gen = torch.Generator().manual_seed(5)
    deep = random_tree_parents(30, gen, "deep")
    trees = [random_tree_parents(10, gen, "random"), deep, torch.arange(-1, 2), torch.tensor([-1])]
    c = make_case(trees, dim=3, width=width, state_len=width + 3, num_slots=6, seed=5)
    deepest = max(range(30), key=lambda i: len(path_of(deep, i)))
    accepted = torch.tensor([0, deepest, 1, 0])  # request 2: path of 2 nodes, shorter than W-1 when W=4
    # slots alias across requests: 0 writes slot 2 which 1 and 2 read, 1 writes slot 1 which 0 and 3
    # read, and the column ranges overlap; requests 2 and 3 keep committed columns in their window
    src = torch.tensor([1, 2, 2, 1])
    dst = torch.tensor([2, 1, 3, 0])
    src_start = torch.tensor([0, 2, 1, 1])
    dst_start = torch.tensor([1, 0, 4, 3])
    before = c["conv_state"].clone()
    tree_conv_commit(c["x"], c["parents"], c["cu_nodes"], accepted, c["conv_state"], src, dst, width,
                     src_start=src_start, dst_start=dst_start)
    expected = before.clone()
    cu = c["cu_nodes"].tolist()
    for r in range(4):
        s, e = cu[r], cu[r + 1]
        p = torch.tensor(path_of(c["parents"][s:e], int(accepted[r]))) + s
        committed = before[int(src[r]), :, int(src_start[r]) : int(src_start[r]) + width - 1]
        seq = torch.cat([committed, c["x"][p].T], dim=1)
        d = int(dst_start[r])
        expected[int(dst[r]), :, d : d + width - 1] = seq[:, seq.shape[1] - (width - 1) :]
    assert torch.equal(c["conv_state"], expected)
    if width == 4:  # request 2 kept one committed column: the path (2 nodes) is shorter than W-1
        assert torch.equal(c["conv_state"][3, :, 4], before[2, :, 3])


def test_commit_then_verify_matches_longer_chain():
    """Committing a chain prefix then verifying the rest equals one conv over the whole chain."""
    c = make_case([torch.arange(-1, 9)], dim=4, seed=8)
    slot = int(c["state_indices"][0])
    seq = torch.cat([c["conv_state"][slot], c["x"].T], dim=1)[None]
    want = F.silu(F.conv1d(seq, c["weight"][:, None, :], c["bias"], groups=4)[0].T)
    tree_conv_commit(c["x"][:5], torch.arange(-1, 4), torch.tensor([0, 5]), torch.tensor([4]), c["conv_state"],
                     c["state_indices"], c["state_indices"], 4)
    rest = dict(c, x=c["x"][5:], parents=torch.arange(-1, 4), cu_nodes=torch.tensor([0, 5]))
    assert torch.allclose(conv(rest), want[5:], rtol=1e-14, atol=1e-14)


def test_errors_are_clear():
    c = make_case([torch.tensor([-1, 0])], state_len=4, seed=0)
    with pytest.raises(ValueError, match=r"window_start\[0\] = 2: the committed window \(columns 2..4\) does not fit"):
        conv(c, window_start=torch.tensor([2]))
    with pytest.raises(ValueError, match="activation must be 'silu' or None"):
        conv(c, activation="relu")
    two = make_case([torch.tensor([-1]), torch.tensor([-1])], seed=0)
    with pytest.raises(ValueError, match="dst_indices must be distinct"):
        tree_conv_commit(two["x"], two["parents"], two["cu_nodes"], torch.tensor([0, 0]), two["conv_state"],
                         two["state_indices"], torch.tensor([0, 0]), 4)
    with pytest.raises(ValueError, match=r"accepted\[0\] = 2 is not a node of request 0"):
        tree_conv_commit(c["x"], c["parents"], c["cu_nodes"], torch.tensor([2]), c["conv_state"],
                         c["state_indices"], c["state_indices"], 4)

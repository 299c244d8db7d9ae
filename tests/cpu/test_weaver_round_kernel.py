"""The Weaver round kernel (``cuda/weaver_round.cu`` behind ``vllm_tfm.kernels.weaver_round``) run on
the CPU through the CUDA emulation (``cuda/host_emu``), against the torch round
(``weaver_round_reference``) it replaces, round by round, and against the per-request reference
``build_weaver``: random problems (smooth, exact ties, mostly -inf rows; float64 / float32 /
bfloat16 / float16 scorer outputs), ragged per-request budgets, widths and depths, n = 1, chains,
stars, deep trees, K not a multiple of the warp, children_per_node >= K; the scorer-output check;
and the selection rules (when the kernel is taken, why not)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _emulation import emulated, emulation_build_dir
from test_padded_builders import BatchedWeaverTable, WeaverTable, assert_same_trees

from vllm_tfm.kernels import weaver_round as kw
from vllm_tfm.tree import build_weaver
from vllm_tfm.tree.weaver_padded import (
    RoundOutputs,
    WeaverGrowth,
    weaver_round_reference,
)

OUT_FIELDS = ("node", "parent", "tok", "d", "depth_words", "score")  # compared on the taken columns


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_weaver")


class Recording:
    """A round function that records (a copy of) every round's outputs."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.rounds: list[RoundOutputs] = []

    def __call__(self, g, *args) -> RoundOutputs:
        o = self.fn(g, *args)
        self.rounds.append(RoundOutputs(*(t.clone() for t in vars(o).values())))
        return o


def grow(roots, cands, scorer, budgets, depths, widths, cpn, kernel: bool):
    g = WeaverGrowth(torch.tensor(roots), cands, scorer, budgets, depths, widths, cpn)
    rec = Recording(kw.KernelRound(g) if kernel else weaver_round_reference)
    g.round_fn = rec
    g.run_fixed()
    g.run_tail()
    return g, g.trees(), rec


def assert_same_rounds(ref: Recording, got: Recording) -> None:
    assert len(ref.rounds) == len(got.rounds)
    for i, (a, b) in enumerate(zip(ref.rounds, got.rounds)):
        for name in ("n_alive", "take", "room", "expand"):
            assert torch.equal(getattr(a, name), getattr(b, name)), f"round {i}: {name}"
        taken = torch.arange(a.node.shape[1])[None, :] < a.take[:, None]  # columns past take: trash rows
        for name in OUT_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x[taken], y[taken]), f"round {i}: {name}"


def assert_same_state(a: WeaverGrowth, b: WeaverGrowth) -> None:
    real = a.trash_slot  # slots of real nodes; the trash node's c slots are written by invalid rows
    assert torch.equal(a.fi[:, :real], b.fi[:, :real]) and torch.equal(a.ff[:, :real], b.ff[:, :real])
    assert torch.equal(a.node_slot[:, : a.n_cap], b.node_slot[:, : a.n_cap])
    assert torch.equal(a.left, b.left) and torch.equal(a.fine, b.fine)
    assert a.calls == b.calls and a.rounds == b.rounds


def kernel_case(seed, r_, budgets, depths, widths, k, cpn, kind, dtype, emu_dir, extra_rows=0):
    g = random.Random(seed)
    d_rows = max(depths) + extra_rows
    vocab = max(3 * k, 20)
    cands = torch.tensor([[g.sample(range(vocab), k) for _ in range(d_rows)] for _ in range(r_)], dtype=torch.long)
    roots = [g.randrange(vocab) for _ in range(r_)]
    tables = [WeaverTable(seed * 31 + r, roots[r], cands[r], kind, dtype) for r in range(r_)]
    refs = [build_weaver(roots[r], cands[r], tables[r], budgets[r], depths[r], widths[r], cpn) for r in range(r_)]
    ga, ta, ra = grow(roots, cands, BatchedWeaverTable(tables, depths, dtype), budgets, depths, widths, cpn, False)
    with emulated(emu_dir) as launches:
        gb, tb, rb = grow(roots, cands, BatchedWeaverTable(tables, depths, dtype), budgets, depths, widths, cpn, True)
    assert [name for name, _, _ in launches] == ["weaver_round"] * len(rb.rounds)
    assert all(grid == (r_, 1, 1) for _, grid, _ in launches)
    assert_same_rounds(ra, rb)
    assert_same_state(ga, gb)
    for name in ("tokens", "parents", "depth", "scores", "draft_logprobs", "num_nodes"):
        x, y = getattr(ta, name), getattr(tb, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    if dtype in (torch.float32, torch.float64):  # build_weaver's tree scores are in the output dtype
        assert_same_trees(tb, refs, budgets)
    return tb, refs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["smooth", "ties", "sparse"])
def test_kernel_rounds_equal_the_torch_rounds_on_random_problems(kind, emu_dir):
    g = random.Random(f"weaver-kernel-{kind}")
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    for case in range(6):
        r_ = g.randint(1, 4)
        k = g.choice([1, 3, 5, 9, 37, 70])
        cpn = g.choice([1, 2, 3, 8, 64])
        shared = g.random() < 0.5
        w0 = g.randint(1, 6)
        budgets = [g.randint(1, 40) for _ in range(r_)]
        depths = [g.randint(1, 7) for _ in range(r_)]
        widths = [w0 if shared else g.randint(1, 6) for _ in range(r_)]
        kernel_case(1000 * case + k, r_, budgets, depths, widths, k, cpn, kind, dtypes[case % 4], emu_dir, case % 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [
        # (R, budgets, depths, widths, K, cpn): n = 1; a chain (one child per node); a star (depth 1);
        # a deep tree (15 levels, rank paths over several digits); K > 32 not a multiple of 32 with
        # the zoo's cpn; widths up to the kernel's largest with more nodes than one word of ranks
        ("n1", 1, [1], [3], [1], 8, 8),
        ("chain", 2, [15, 9], [15, 15], [1, 1], 4, 1),
        ("star", 1, [20], [1], [4], 33, 8),
        ("deep", 2, [48, 31], [15, 15], [2, 1], 40, 8),
        ("wide", 1, [130], [15], [64], 70, 8),
        ("mixed", 3, [32, 5, 17], [15, 3, 6], [2, 4, 3], 512, 8),
    ],
    ids=lambda s: s[0],
)
def test_kernel_rounds_on_edge_trees(shape, emu_dir):
    _, r_, budgets, depths, widths, k, cpn = shape
    tree, refs = kernel_case(hash(shape[0]) % 1000, r_, budgets, depths, widths, k, cpn, "smooth", torch.float32,
                             emu_dir)
    assert [int(n) for n in tree.num_nodes] == [t.num_nodes for t in refs]


@pytest.mark.slow
def test_kernel_clears_the_flag_on_a_positive_or_nan_valid_row_only(emu_dir):
    cands = torch.arange(2 * 3 * 4).view(2, 3, 4)

    def scorer(bad):
        def fn(ids, parents, tokens, depths, valid):
            out = torch.full((*ids.shape, 4), -1.0)
            out[~valid] = float("nan")  # invalid rows are never read
            if bad is not None:
                out[1, 0, 2] = bad
            return out
        return fn

    with emulated(emu_dir):
        for bad, fine in ((None, True), (0.5, False), (float("nan"), False)):
            g = WeaverGrowth(torch.tensor([0, 1]), cands, scorer(bad), 4, 3, 2, 2)
            g.round_fn = kw.KernelRound(g)
            g.start()
            assert bool(g.fine) is fine
            if not fine:
                with pytest.raises(ValueError, match="log-probabilities"):
                    g.pending()


def test_the_kernel_is_taken_for_cuda_growths_only_and_says_why_not(monkeypatch):
    cands = torch.arange(2 * 3 * 8).view(2, 3, 8)
    g = WeaverGrowth(torch.tensor([0, 1]), cands, lambda *a: None, 16, 3, 2)
    assert kw.unsupported_reason(g) == kw.NOT_CUDA
    assert kw.round_fn_for(g) is None  # CPU: the torch round, no warning
    # the limits, on a growth whose frontier claims to be on a GPU
    class FakeCuda:
        type = "cuda"
        index = 0

    monkeypatch.setattr(g, "fi", type("T", (), {"device": FakeCuda(), "shape": g.fi.shape})())
    monkeypatch.setattr(g, "w", 65)
    assert kw.unsupported_reason(g) == "width 65 is over the kernel's 64 nodes per round"
    monkeypatch.setattr(g, "w", 2)
    monkeypatch.setattr(g, "nw", 5)
    assert kw.unsupported_reason(g) == "5 rank-path words are over the kernel's 4"
    monkeypatch.setattr(g, "nw", 1)
    monkeypatch.setattr(kw, "kernels_unavailable_reason", lambda i: "no NVRTC here")
    assert kw.unsupported_reason(g) == "no NVRTC here"
    monkeypatch.setattr(kw, "kernels_unavailable_reason", lambda i: None)
    monkeypatch.setattr(kw, "device_smem_optin", lambda i: 100)
    assert kw.unsupported_reason(g) == (  # per slot a score and one word (nw = 1), per warp (4) a row of K float64 values and c children
        f"the frontier keys and scored rows need {(g.fi.shape[1] * 2 + 4 * (g.k + g.c)) * 8 + 4 * g.c * 4} bytes "
        "of shared memory; "
        "the device allows 100"
    )
    monkeypatch.setattr(kw, "device_smem_optin", lambda i: 227 * 1024)
    assert kw.unsupported_reason(g) is None
    monkeypatch.setenv(kw.ENV_SWITCH, "0")
    assert kw.round_fn_for(g) is None

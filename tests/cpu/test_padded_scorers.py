"""Batched model scorers (Weaver, TreeFlash) against their per-request versions, and the
``vllm_tfm.models.proposal_trees`` glue against the per-request builders with per-request scorers."""

from __future__ import annotations

import pytest
import torch

from _models import Recorder, randomize

from vllm_tfm.models import (
    BatchedTreeFlashTransitionScorer,
    BatchedWeaverTreeScorer,
    TreeFlashApproximator,
    TreeFlashConfig,
    TreeFlashTransitionScorer,
    Weaver,
    WeaverConfig,
    treeflash_padded_trees,
    weaver_draft_trees,
    weaver_padded_trees,
)
from vllm_tfm.models.common import RMSNorm
from vllm_tfm.tree import build_treeflash, build_weaver, build_weaver_padded

F64 = torch.float64
V, H = 64, 32


pytestmark = pytest.mark.usefixtures("one_thread")


def weaver_inputs(r: int, depth: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    cfg = WeaverConfig(d_model=H, d_rank=16, n_layers=2, n_heads=2, d_mlp=24, max_depth=6)
    w = randomize(Weaver(cfg), seed=seed).to(dtype).eval()
    embed = torch.randn(V, H, generator=g, dtype=F64).to(dtype)
    head = (torch.randn(V, H, generator=g, dtype=F64) * 0.5).to(dtype)
    logits = (torch.randn(r, depth, V, generator=g, dtype=F64) * 2).to(dtype)
    dh = torch.randn(r, depth, H, generator=g, dtype=F64).to(dtype)
    vh = torch.randn(r, H, generator=g, dtype=F64).to(dtype)
    roots = torch.randint(0, V, (r,), generator=g)
    return w, embed, head, logits, dh, vh, roots


# float32: the two scorers are one function in another order (folded weights, fused reductions), so
# they differ by float32 rounding relative to the log-probabilities' size (2.03e-5 absolute at a value
# of 2.1, 9.6e-6 relative, seen on an AMD EPYC CPU with OpenBLAS's Haswell kernels): rtol 1e-5 on top
# of atol 2e-5; float64 stays at 1e-12 absolute.
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float64, 1e-12, 0.0), (torch.float32, 2e-5, 1e-5)])
def test_batched_weaver_scorer_equals_per_request_scorer_call_by_call(dtype, atol, rtol):
    r_, depth, k, budgets = 4, 5, 9, [20, 7, 33, 1]
    w, embed, head, logits, dh, vh, roots = weaver_inputs(r_, depth, seed=3, dtype=dtype)
    cl, cand = logits.topk(k, dim=-1)
    batched = Recorder(BatchedWeaverTreeScorer(w, vh, dh, cand, cl, embed, head, max_nodes=1 + max(budgets), validate=True))
    build_weaver_padded(roots, cand, batched, budgets, depth, [3, 2, 4, 1], children_per_node=3)
    assert len(batched.calls) >= 8
    compared = 0
    for r in range(r_):
        single = w.tree_scorer(vh[r], dh[r], cand[r], cl[r], embed, head)
        for (ids, par, tok, dep, valid), out in batched.calls:
            cols = valid[r].nonzero().flatten()
            if cols.numel() == 0:
                continue
            want = single(ids[r, cols], par[r, cols], tok[r, cols], dep[r, cols])
            assert out.dtype == want.dtype
            torch.testing.assert_close(out[r, cols], want, rtol=rtol, atol=atol)
            compared += cols.numel()
    assert compared >= 30  # not vacuous: roots and many expanded nodes of every request


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_weaver_padded_trees_equal_build_weaver_with_the_per_request_scorer(dtype):
    r_, depth, budget = 5, 6, 24
    for seed, (k, width, cpn) in enumerate([(12, 2, 4), (5, 3, 2), (30, 1, 8), (3, 4, 1)]):
        w, embed, head, logits, dh, vh, roots = weaver_inputs(r_, depth, seed=10 + seed, dtype=dtype)
        trees, cand = weaver_padded_trees(w, logits, dh, vh, roots, embed, head, budget, k, width, cpn)
        cl, cand_ref = logits.float().topk(k, dim=-1) if dtype != F64 else logits.topk(k, dim=-1)
        assert torch.equal(cand, cand_ref)
        tol = 1e-12 if dtype == F64 else 2e-5
        for r in range(r_):
            ref = build_weaver(int(roots[r]), cand[r], w.tree_scorer(vh[r], dh[r], cand[r], cl[r], embed, head),
                               budget, depth, width, cpn)
            got = trees.tree(r)
            assert got.tokens.tolist() == ref.tokens.tolist() and got.parents.tolist() == ref.parents.tolist()
            torch.testing.assert_close(got.scores, ref.scores, rtol=0, atol=tol * depth)
            torch.testing.assert_close(got.draft_logprobs, ref.draft_logprobs, rtol=0, atol=tol)
        # the runtime layout: the padded trees completed to B draft nodes
        tok, par = weaver_draft_trees(w, logits, dh, vh, roots, embed, head, budget, k, width, cpn)
        n = trees.num_nodes
        assert torch.equal(tok[:, : n.min() - 1], trees.tokens[:, 1 : n.min()])
        assert tok.shape == (r_, budget) and par.shape == (r_, budget + 1)


def test_batched_weaver_scorer_keeps_requests_apart():
    """Request 1's outputs do not move when request 0 grows a different tree."""
    w, embed, head, logits, dh, vh, roots = weaver_inputs(2, 3, seed=5, dtype=F64)
    cl, cand = logits.topk(6, dim=-1)

    def run(tok0: int) -> torch.Tensor:
        s = BatchedWeaverTreeScorer(w, vh, dh, cand, cl, embed, head, max_nodes=4)
        t = lambda x: torch.tensor(x, dtype=torch.long)
        ok = torch.ones(2, 1, dtype=torch.bool)
        s(t([[0], [0]]), t([[-1], [-1]]), t([[int(roots[0])], [int(roots[1])]]), t([[0], [0]]), ok)
        c0, c1 = int(cand[0, 0, 1]), int(cand[1, 0, 2])
        s(t([[1], [1]]), t([[0], [0]]), t([[tok0], [c1]]), t([[1], [1]]), ok)
        return s(t([[2], [2]]), t([[1], [1]]), t([[c0], [int(cand[1, 1, 0])]]), t([[2], [2]]), ok)

    a, b = run(int(cand[0, 0, 0])), run(int(cand[0, 0, 3]))
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert (a[0] - b[0]).abs().max() > 1e-4


def test_batched_weaver_scorer_refuses_protocol_violations_when_validating():
    w, embed, head, logits, dh, vh, _ = weaver_inputs(2, 3, seed=6, dtype=F64)
    cl, cand = logits.topk(4, dim=-1)
    t = lambda x: torch.tensor(x, dtype=torch.long)
    ok = torch.ones(2, 1, dtype=torch.bool)
    s = BatchedWeaverTreeScorer(w, vh, dh, cand, cl, embed, head, max_nodes=5, validate=True)
    with pytest.raises(ValueError, match=r"request 0: node 1 with parent 0: the first call holds the roots"):
        s(t([[1], [1]]), t([[0], [0]]), t([[3], [3]]), t([[1], [1]]), ok)
    s(t([[0], [0]]), t([[-1], [-1]]), t([[3], [4]]), t([[0], [0]]), ok)
    with pytest.raises(ValueError, match=r"request 1: node 2 has parent 1, which was not scored in an earlier call"):
        s(t([[1, 2], [1, 2]]), t([[0, 1], [0, 1]]), t([[3, 3], [3, 3]]), t([[1, 2], [1, 2]]),
          torch.tensor([[True, False], [True, True]]))
    with pytest.raises(ValueError, match=r"request 0: node 0 was already scored"):
        s(t([[0], [1]]), t([[-1], [0]]), t([[3], [3]]), t([[0], [1]]), ok)
    with pytest.raises(ValueError, match=r"request 1: node 1 has depth 2, its parent 0 has depth 0"):
        s(t([[1], [1]]), t([[0], [0]]), t([[3], [3]]), t([[1], [2]]), ok)
    with pytest.raises(ValueError, match=r"request 0: token 64 outside \[0, 64\)"):
        s(t([[1], [1]]), t([[0], [0]]), t([[64], [3]]), t([[1], [1]]), ok)
    with pytest.raises(ValueError, match=r"cand_ids and cand_logits must both be \[R=2, D=3, K\]"):
        BatchedWeaverTreeScorer(w, vh, dh, cand[:, :2], cl[:, :2], embed, head, max_nodes=5)


def treeflash_inputs(r: int, gamma: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    approx = randomize(TreeFlashApproximator(TreeFlashConfig(hidden_size=H, intermediate_size=20)), seed=seed).eval()
    norm = randomize(RMSNorm(H), seed=seed + 1)
    embed = torch.randn(V, H, generator=g, dtype=F64)
    head = torch.randn(V, H, generator=g, dtype=F64) * 0.5
    pre = torch.randn(r, gamma, H, generator=g, dtype=F64)
    marg = torch.log_softmax(norm(pre[:, 1:]) @ head.T, dim=-1).detach()
    roots = torch.randint(0, V, (r,), generator=g)
    return approx, norm, embed, head, pre, marg, roots


def test_batched_treeflash_scorer_equals_per_request_and_drives_the_padded_builder():
    r_, gamma = 4, 6
    approx, norm, embed, head, pre, marg, roots = treeflash_inputs(r_, gamma, seed=7)
    batched = BatchedTreeFlashTransitionScorer(approx, norm, pre, embed, head)
    prev = torch.randint(0, V, (r_, 5), generator=torch.Generator().manual_seed(8))
    for d in (1, 3, 5):
        out = batched(d, prev)
        assert out.shape == (r_, 5, V)
        for r in range(r_):
            single = TreeFlashTransitionScorer(approx, norm, pre[r], embed, head)
            torch.testing.assert_close(out[r], single(d, prev[r]), rtol=0, atol=1e-12)
    for budget, depth, top_m in [(30, 5, 4), (9, 3, 2), (64, 5, 16)]:
        trees = treeflash_padded_trees(approx, norm, pre, marg, roots, embed, head, budget, depth, top_m)
        for r in range(r_):
            ref = build_treeflash(int(roots[r]), marg[r], TreeFlashTransitionScorer(approx, norm, pre[r], embed, head),
                                  budget, depth, top_m)
            got = trees.tree(r)
            assert got.tokens.tolist() == ref.tokens.tolist() and got.parents.tolist() == ref.parents.tolist()
            torch.testing.assert_close(got.scores, ref.scores, rtol=0, atol=1e-11)
        tok, par = treeflash_padded_trees(approx, norm, pre, marg, roots, embed, head, budget, depth, top_m).draft_layout(marg[:, 0].argmax(-1))
        assert tok.shape == (r_, budget) and par.shape == (r_, budget + 1)
    with pytest.raises(ValueError, match=r"prev_tokens must be \[R=4, M\]"):
        batched(1, prev[:2])


def test_given_kv_buffers_hold_garbage_yet_score_as_the_scorers_own_and_wrong_ones_are_refused():
    """``kv_cache`` (``BatchedWeaverTreeScorer.prompt_buffers``, what a caller with a prompt stream makes before
    its fork event) may hold anything: the prompt pass zeroes it first, so the scores equal those of a scorer
    that allocated its own buffers; buffers of another shape are refused with a one-line error."""
    w, embed, head, logits, dh, vh, roots = weaver_inputs(2, 3, seed=8, dtype=F64)
    cl, cand = logits.topk(5, dim=-1)
    t = lambda x: torch.tensor(x, dtype=torch.long)
    ok = torch.ones(2, 1, dtype=torch.bool)

    def scores(kv):
        s = BatchedWeaverTreeScorer(w, vh, dh, cand, cl, embed, head, max_nodes=4, kv_cache=kv)
        first = s(t([[0], [0]]), t([[-1], [-1]]), t([[int(roots[0])], [int(roots[1])]]), t([[0], [0]]), ok)
        return first, s(t([[1], [1]]), t([[0], [0]]), t([[int(cand[0, 0, 1])], [int(cand[1, 0, 0])]]), t([[1], [1]]), ok)

    kv = BatchedWeaverTreeScorer.prompt_buffers(w, vh, dh, 4)
    assert [tuple(b.shape) for b in kv] == [(2, 2, 2, 1 + 3 + 4 + 1, 8)] * 2
    for b in kv:
        b.fill_(float("nan"))
    for a, b in zip(scores(None), scores(kv)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"kv_cache must be 2 buffers of \(shape, dtype, device\)"):
        BatchedWeaverTreeScorer(w, vh, dh, cand, cl, embed, head, max_nodes=4,
                                kv_cache=BatchedWeaverTreeScorer.prompt_buffers(w, vh, dh, 3))

"""Lockstep (padded, batched) tree builders against the per-request reference builders.

``build_weaver_padded`` / ``build_treeflash_padded`` grow R trees together; for every request the
result must equal ``build_weaver`` / ``build_treeflash`` run alone: same tokens, parents, depths,
node order, scores and draft log-probabilities, exactly. ``build_weaver_padded`` must also equal
the previous lockstep implementation (``_weaver_before``) tensor for tensor. Scorers here are lazily drawn tables of
conditional distributions keyed by the realised token path (smooth values, exact ties from a small
set, many -inf entries), so no model rounding is involved.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from _weaver_before import build_weaver_padded_before

from vllm_tfm.tree import (
    PaddedTrees,
    Tree,
    build_treeflash,
    build_treeflash_padded,
    build_weaver,
    build_weaver_padded,
)
from vllm_tfm.tree.padded import RankPathCode, sort_by_key, stable_topk

NEG_INF = float("-inf")
KINDS = ("smooth", "ties", "sparse")


def draw_row(seed: int, key: tuple, n: int, kind: str) -> list[float]:
    """n log-probabilities for ``key`` (deterministic): smooth, ties from {0,-1,-2,-3,-inf}, or sparse."""
    g = random.Random(repr((seed, kind) + key))  # str seeds are hashed with sha512: stable
    if kind == "smooth":
        x = [g.gauss(0.0, 1.5) for _ in range(n)]
        lse = max(x) + math.log(sum(math.exp(v - max(x)) for v in x))
        return [v - lse for v in x]
    if kind == "ties":
        return [g.choice([0.0, -1.0, -2.0, -3.0, NEG_INF]) for _ in range(n)]
    return [NEG_INF if g.random() < 0.6 else -float(g.randint(0, 4)) for _ in range(n)]


def tree_lists(t: Tree) -> tuple[list, ...]:
    return t.tokens.tolist(), t.parents.tolist(), t.depth.tolist(), t.scores.tolist(), t.draft_logprobs.tolist()


def assert_same_trees(padded: PaddedTrees, refs: list[Tree], budgets: list[int]) -> None:
    assert padded.tokens.shape == (len(refs), 1 + max(budgets))
    for r, ref in enumerate(refs):
        got = padded.tree(r)
        assert tree_lists(got) == tree_lists(ref), f"request {r}"
        assert got.scores.dtype == ref.scores.dtype
        n = ref.num_nodes  # padding: token 0, parent -1, depth 0
        assert padded.parents[r, n:].eq(-1).all() and padded.tokens[r, n:].eq(0).all()


# --------------------------------------------------------------------------------------------
# Weaver
# --------------------------------------------------------------------------------------------


class WeaverTable:
    """Per-request scorer (build_weaver protocol) over a lazy path table; records its calls."""

    def __init__(self, seed: int, root: int, candidates: torch.Tensor, kind: str, dtype: torch.dtype):
        self.seed, self.root, self.cand, self.kind, self.dtype = seed, root, candidates.tolist(), kind, dtype
        self.paths: dict[int, tuple[int, ...]] = {}
        self.calls: list[list[int]] = []

    def row(self, node: int, parent: int, token: int, depth: int) -> list[float]:
        path = () if parent == -1 else self.paths[parent] + (token,)
        assert depth == len(path)
        if depth:
            assert token in self.cand[depth - 1]
        self.paths[node] = path
        return draw_row(self.seed, path, len(self.cand[0]), self.kind)

    def __call__(self, ids, parents, tokens, depths):
        self.calls.append(ids.tolist())
        rows = [self.row(*x) for x in zip(ids.tolist(), parents.tolist(), tokens.tolist(), depths.tolist())]
        return torch.tensor(rows, dtype=self.dtype)


class BatchedWeaverTable:
    """Batched scorer (build_weaver_padded protocol) over the same tables; checks the protocol,
    fills invalid rows with NaN (they must be ignored), records per-request valid node lists."""

    def __init__(self, tables: list[WeaverTable], max_depths: list[int], dtype: torch.dtype):
        self.tables = [WeaverTable(t.seed, t.root, torch.tensor(t.cand), t.kind, dtype) for t in tables]
        self.max_depths = max_depths
        self.calls: list[list[int]] = [[] for _ in tables]  # per request: node lists of non-empty calls
        self.per_call: list[list[list[int]]] = [[] for _ in tables]
        self.num_calls = 0
        self.dtype = dtype

    def __call__(self, ids, parents, tokens, depths, valid):
        r_, w = ids.shape
        for x in (ids, parents, tokens, depths):
            assert x.dtype == torch.int64 and x.shape == (r_, w)
        assert valid.dtype == torch.bool and valid.shape == (r_, w)
        if self.num_calls == 0:
            assert w == 1 and valid.all() and ids.eq(0).all() and parents.eq(-1).all() and depths.eq(0).all()
        self.num_calls += 1
        out = torch.full((r_, w, len(self.tables[0].cand[0])), float("nan"), dtype=self.dtype)
        for r in range(r_):
            cols = valid[r].nonzero().flatten().tolist()
            nodes = [int(ids[r, i]) for i in cols]
            assert nodes == sorted(nodes) and all(n not in self.tables[r].paths for n in nodes)
            for i in cols:
                assert int(depths[r, i]) < self.max_depths[r]
                if int(parents[r, i]) != -1:
                    assert int(parents[r, i]) in self.tables[r].paths  # scored in an EARLIER call
            for i in cols:
                row = self.tables[r].row(int(ids[r, i]), int(parents[r, i]), int(tokens[r, i]), int(depths[r, i]))
                out[r, i] = torch.tensor(row, dtype=self.dtype)
            if nodes:
                self.calls[r].append(nodes)
        return out


def weaver_case(seed: int, r_: int, budgets, depths, widths, k: int, cpn: int, kind: str, dtype=torch.float64, extra_rows=0):
    g = random.Random(seed)
    d_rows = max(depths) + extra_rows
    vocab = max(3 * k, 20)
    cands = torch.tensor([[g.sample(range(vocab), k) for _ in range(d_rows)] for _ in range(r_)], dtype=torch.long)
    roots = [g.randrange(vocab) for _ in range(r_)]
    tables = [WeaverTable(seed * 31 + r, roots[r], cands[r], kind, dtype) for r in range(r_)]
    refs = [
        build_weaver(roots[r], cands[r], tables[r], budgets[r], depths[r], widths[r], cpn) for r in range(r_)
    ]
    batched = BatchedWeaverTable(tables, depths, dtype)
    padded = build_weaver_padded(torch.tensor(roots), cands, batched, budgets, depths, widths, cpn)
    assert_same_trees(padded, refs, budgets)
    # each request's scorer saw the same node batches, in the same order, as with the reference
    for r in range(r_):
        assert batched.calls[r] == tables[r].calls, f"request {r}"
    # and the previous lockstep builder (frozen copy) gives the same padded tensors and calls
    before = BatchedWeaverTable(tables, depths, dtype)
    old = build_weaver_padded_before(torch.tensor(roots), cands, before, budgets, depths, widths, cpn)
    for name in ("tokens", "parents", "depth", "scores", "draft_logprobs", "num_nodes"):
        a, b = getattr(padded, name), getattr(old, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert before.num_calls == batched.num_calls and before.calls == batched.calls
    return padded, refs, batched, tables


@pytest.mark.parametrize("kind", KINDS)
def test_weaver_padded_equals_per_request_on_random_problems(kind):
    g = random.Random(f"weaver-{kind}")
    for case in range(40):
        r_ = g.randint(1, 8)
        k = g.choice([1, 2, 3, 5, 9, 40])
        cpn = g.choice([1, 2, 3, 8, 64])
        shared_w = g.random() < 0.5
        w0 = g.randint(1, 8)
        budgets = [g.randint(1, 70) for _ in range(r_)]
        depths = [g.randint(1, 7) for _ in range(r_)]
        widths = [w0 if shared_w else g.randint(1, 8) for _ in range(r_)]
        dtype = torch.float32 if case % 3 == 0 else torch.float64
        weaver_case(1000 * case + k, r_, budgets, depths, widths, k, cpn, kind, dtype, extra_rows=case % 2)


def test_weaver_padded_short_frontiers_and_binding_depth():
    # one child per node and K = 1: every step finds one frontier entry whatever the width, so
    # rounds run past ceil(B / w); depths 1..3 bind well before the budget is reached
    _, refs, batched, _ = weaver_case(7, 4, [9, 30, 2, 17], [3, 30, 1, 2], [4, 8, 2, 3], 1, 1, "smooth")
    assert [t.num_nodes for t in refs] == [4, 31, 2, 3]
    assert batched.num_calls == 30  # the deepest chain needs one step per node
    # cpn 2, K 2, all-finite: widths cannot be filled in the first steps either
    weaver_case(8, 3, [40, 40, 40], [6, 4, 6], [8, 5, 8], 2, 2, "smooth")


def test_weaver_padded_call_count_is_ceil_budget_over_width_when_the_frontier_is_wide():
    # children_per_node >= width, all-finite rows, depth never binding: the reference makes
    # ceil(B / w) calls, and so does the lockstep loop (one call per step for all requests)
    budgets, widths = [64, 33, 17, 64], [4, 4, 2, 8]
    _, _, batched, tables = weaver_case(9, 4, budgets, [30] * 4, widths, 16, 8, "smooth")
    for t, b, w in zip(tables, budgets, widths):
        assert len(t.calls) == math.ceil(b / w)
    assert batched.num_calls == max(math.ceil(b / w) for b, w in zip(budgets, widths))


def test_weaver_padded_requests_finishing_at_different_rounds_with_exact_ties():
    # all-zero log-probabilities: every path ties, only the rank paths order the frontier
    class Flat(WeaverTable):
        def row(self, node, parent, token, depth):
            super().row(node, parent, token, depth)
            return [0.0] * len(self.cand[0])

    cands = torch.arange(2 * 4 * 3).view(2, 4, 3)
    refs, tabs = [], []
    for r, b in enumerate([5, 23]):
        t = Flat(0, r, cands[r], "smooth", torch.float64)
        tabs.append(t)
        refs.append(build_weaver(r, cands[r], t, b, 4, 3, 2))
    batched = BatchedWeaverTable(tabs, [4, 4], torch.float64)
    batched.tables = [Flat(0, r, cands[r], "smooth", torch.float64) for r in range(2)]
    padded = build_weaver_padded([0, 1], cands, batched, [5, 23], 4, 3, 2)
    assert_same_trees(padded, refs, [5, 23])
    # rank-path order among ties: breadth-first by rank paths within each step
    assert refs[0].parents.tolist() == [-1, 0, 0, 1, 1, 2]


def test_weaver_padded_rejects_bad_scorer_output_and_bad_candidates():
    cands = torch.arange(12).view(1, 3, 4)

    def positive(ids, parents, tokens, depths, valid):
        return torch.full((*ids.shape, 4), 0.5)

    with pytest.raises(ValueError, match=r"scorer output must be log-probabilities \(<= 0, no NaN\)"):
        build_weaver_padded([0], cands, positive, 5, 3, 2)

    def wrong_shape(ids, parents, tokens, depths, valid):
        return torch.zeros(*ids.shape, 3)

    with pytest.raises(ValueError, match=r"scorer output \(call 1\) must have shape \[1, 1, 4\], got \(1, 1, 3\)"):
        build_weaver_padded([0], cands, wrong_shape, 5, 3, 2)
    dup = cands.clone()
    dup[0, 1, 2] = dup[0, 1, 0]
    with pytest.raises(ValueError, match="candidates of request 0, depth 2 contain a repeated token id"):
        build_weaver_padded([0], dup, positive, 5, 3, 2)
    with pytest.raises(ValueError, match="candidates has 3 depth rows but max_depth is 4"):
        build_weaver_padded([0], cands, positive, 5, 4, 2)
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        build_weaver_padded([0], cands, positive, 0, 3, 2)
    with pytest.raises(ValueError, match=r"width has 2 entries for 1 requests"):
        build_weaver_padded([0], cands, positive, 4, 3, [1, 2])
    with pytest.raises(ValueError, match=r"root tokens must be >= 0, got \[-3\]"):
        build_weaver_padded([-3], cands, positive, 4, 3, 2)


# --------------------------------------------------------------------------------------------
# TreeFlash
# --------------------------------------------------------------------------------------------


def stage1_tokens(marg_row: list[float], m: int) -> list[int]:
    return sorted(range(len(marg_row)), key=lambda i: (-marg_row[i], i))[:m]


class TransitionRows:
    """Lazy transition table of one request: (depth, previous token) -> [V] log-probabilities."""

    def __init__(self, seed: int, vocab: int, kind: str, dtype: torch.dtype):
        self.seed, self.vocab, self.kind, self.dtype = seed, vocab, kind, dtype

    def row(self, d: int, prev: int) -> list[float]:
        return draw_row(self.seed, (d, prev), self.vocab, self.kind)

    def __call__(self, d, prev):
        return torch.tensor([self.row(d, p) for p in prev.tolist()], dtype=self.dtype)


class BatchedTransitions:
    """Batched transition scorer over per-request tables; checks the call protocol and returns
    NaN rows for requests whose max_depth is below d (they must be ignored)."""

    def __init__(self, tables, roots, marg, depths, top_m):
        self.tables, self.roots, self.marg, self.depths, self.top_m = tables, roots, marg, depths, top_m
        self.calls: list[int] = []

    def __call__(self, d, prev):
        assert d == len(self.calls) + 1 and d <= max(self.depths)
        self.calls.append(d)
        r_ = len(self.tables)
        out = torch.full((r_, prev.shape[1], self.tables[0].vocab), float("nan"), dtype=self.tables[0].dtype)
        for r in range(r_):
            if d > self.depths[r]:
                continue
            want = [self.roots[r]] if d == 1 else stage1_tokens(self.marg[r, d - 2].tolist(), self.top_m)
            assert prev[r].tolist() == want
            out[r] = self.tables[r](d, prev[r])
        return out


def treeflash_case(seed: int, r_: int, budgets, depths, vocab: int, top_m: int, kind: str, dtype=torch.float64):
    g = random.Random(seed)
    d_rows = max(depths) + g.randint(0, 1)
    marg = torch.tensor(
        [[draw_row(seed, (r, d, "m"), vocab, "ties" if kind == "sparse" else kind) for d in range(d_rows)] for r in range(r_)],
        dtype=dtype,
    )
    roots = [g.randrange(vocab) for _ in range(r_)]
    tables = [TransitionRows(seed * 17 + r, vocab, kind, dtype) for r in range(r_)]
    refs = [build_treeflash(roots[r], marg[r], tables[r], budgets[r], depths[r], top_m) for r in range(r_)]
    scorer = BatchedTransitions(tables, roots, marg, depths, min(top_m, vocab))
    padded = build_treeflash_padded(torch.tensor(roots), marg, scorer, budgets, depths, top_m)
    assert_same_trees(padded, refs, budgets)
    assert scorer.calls == list(range(1, max(depths) + 1))
    return padded, refs


@pytest.mark.parametrize("kind", KINDS)
def test_treeflash_padded_equals_per_request_on_random_problems(kind):
    g = random.Random(f"treeflash-{kind}")
    for case in range(40):
        r_ = g.randint(1, 8)
        vocab = g.choice([1, 2, 4, 7, 60])
        top_m = g.choice([1, 2, 3, 16])
        budgets = [g.randint(1, 70) for _ in range(r_)]
        depths = [g.randint(1, 6) for _ in range(r_)]
        dtype = torch.float32 if case % 3 == 0 else torch.float64
        treeflash_case(500 * case + vocab, r_, budgets, depths, vocab, top_m, kind, dtype)


def test_treeflash_padded_budget_larger_than_the_restricted_graph():
    padded, refs = treeflash_case(3, 3, [70, 70, 5], [3, 2, 3], 4, 2, "smooth")
    # M = 2 and depth <= 3: at most 2 + 4 + 8 nodes exist, fewer where a token misses stage 1
    assert refs[0].num_nodes <= 15 and refs[1].num_nodes <= 7 and refs[2].num_nodes == 6
    assert padded.num_nodes.tolist() == [t.num_nodes for t in refs]


def test_treeflash_padded_rejects_bad_transitions():
    marg = torch.zeros(2, 3, 4).log_softmax(-1)
    with pytest.raises(ValueError, match=r"transition_scorer output at depth 1 must have shape \[2, 1, 4\]"):
        build_treeflash_padded([0, 1], marg, lambda d, prev: torch.zeros(2, 1, 5), 4, 2)

    def nan_for_request_1(d, prev):
        out = torch.zeros(2, prev.shape[1], 4).log_softmax(-1)
        out[1] = float("nan")
        return out

    with pytest.raises(ValueError, match=r"log-probabilities \(<= 0, no NaN\)"):
        build_treeflash_padded([0, 1], marg, nan_for_request_1, 4, 2)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_stable_topk_is_a_truncated_stable_sort(dtype):
    g = torch.Generator().manual_seed(0)
    for n, k in [(50, 3), (200, 8), (7, 7), (9, 1), (512, 16), (5000, 16), (4500, 1)]:
        x = torch.randint(-6, 1, (4, 3, n), generator=g).to(dtype) / 2  # many exact ties
        x[0, 0, :5] = -0.0
        x[0, 1, 1::3] = float("-inf")
        vals, idx = stable_topk(x, k)
        for row, vr, ir in zip(x.reshape(-1, n).tolist(), vals.reshape(-1, k).tolist(), idx.reshape(-1, k).tolist()):
            want = sorted(range(n), key=lambda i: (-row[i], i))[:k]
            assert ir == want and vr == [row[i] for i in want]


def test_sort_by_key_orders_by_score_then_rank_path_with_dead_entries_last():
    g = random.Random(0)
    code = RankPathCode(num_ranks=5, max_len=13)  # 3 bits a digit, 20 digits a word: one word
    code2 = RankPathCode(num_ranks=300, max_len=13)  # 9 bits a digit, 6 digits a word: three words
    assert (code.words, code2.words) == (1, 3)
    for cd in (code, code2):
        paths, scores, alive = [], [], []
        for _ in range(60):
            paths.append(tuple(g.randrange(cd.num_ranks) for _ in range(g.randint(0, 13))))
            scores.append(g.choice([0.0, -1.0, -2.5, NEG_INF]))
            alive.append(g.random() < 0.8)
        words = torch.zeros(1, 60, cd.words, dtype=torch.long)
        for i, p in enumerate(paths):
            for pos, rank in enumerate(p):
                words[0, i] += cd.digit(torch.tensor(pos), torch.tensor(rank))
        perm = sort_by_key(torch.tensor([scores], dtype=torch.float64), words, torch.tensor([alive]))[0].tolist()
        live = [i for i in perm if alive[i]]
        assert perm[: len(live)] == sorted((i for i in range(60) if alive[i]), key=lambda i: (-scores[i], paths[i], i))
        assert len(live) == sum(alive)


def test_padded_builders_with_rows_longer_than_4096():
    """Rows of more than 4096 entries take the topk path of ``stable_topk``: the same trees.
    Scores depend on (depth, token) only and come from a few levels, so ties are everywhere."""
    g = torch.Generator().manual_seed(5)
    r_, depth, n = 3, 3, 5000
    levels = torch.tensor([0.0, -0.5, -1.0, -2.0, NEG_INF])
    base = levels[torch.randint(0, 5, (r_, depth, 7, n), generator=g)]  # [R, depth, 7 token classes, n]
    base[..., 0] = -0.5  # every row has a finite entry
    for dtype in (torch.float32, torch.bfloat16):
        table = base.to(dtype)
        # Weaver: K = n candidates per depth
        cands = torch.stack([torch.stack([torch.randperm(3 * n, generator=g)[:n] for _ in range(depth)]) for _ in range(r_)])
        roots = [3, 8, 13]
        refs = [
            build_weaver(roots[r], cands[r], lambda ids, p, t, d, r=r, tb=table: tb[r, d, t % 7], b, depth, 3, 6)
            for r, b in enumerate([20, 9, 33])
        ]
        rows = torch.arange(r_)[:, None]
        padded = build_weaver_padded(
            roots, cands, lambda ids, p, t, d, ok, tb=table, rw=rows: tb[rw, d.clamp(max=depth - 1), t % 7], [20, 9, 33], depth, 3, 6
        )
        assert_same_trees(padded, refs, [20, 9, 33])
        # TreeFlash: V = n
        marg = table[:, :, 0].float().log_softmax(-1).to(dtype)
        refs = [
            build_treeflash(roots[r], marg[r], lambda d, prev, r=r, tb=table: tb[r, d - 1, prev % 7], b, depth, 4)
            for r, b in enumerate([20, 9, 33])
        ]
        padded = build_treeflash_padded(roots, marg, lambda d, prev, tb=table, rw=rows: tb[rw, d - 1, prev % 7], [20, 9, 33], depth, 4)
        assert_same_trees(padded, refs, [20, 9, 33])

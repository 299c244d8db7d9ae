"""Tree builders (chain, DDTree, Weaver, TreeFlash) against brute-force enumeration.

The brute force below never uses the builders' heaps or torch sorting: it enumerates every root
path of the candidate space, ranks children with Python's sort (key: -log-prob, then index), and
orders nodes by the claimed key (-path score, rank path). Small vocabularies and depths (V <= 5,
D <= 4), float64, exact equality.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest
import torch

from vllm_tfm.tree import (
    Tree,
    TreeBatch,
    build_chain,
    build_chain_batch,
    build_ddtree,
    build_ddtree_batch,
    build_treeflash,
    build_treeflash_batch,
    build_weaver,
    build_weaver_batch,
    default_weaver_width,
)

NEG_INF = float("-inf")

# --------------------------------------------------------------------------------------------
# brute force
# --------------------------------------------------------------------------------------------

# children(token_path) -> the parent's children in rank order as (token, logq); token_path is the
# tuple of draft tokens from depth 1 to the parent (() for the root).
Children = Callable[[tuple[int, ...]], list[tuple[int, float]]]


def rank_order(values: list[float]) -> list[int]:
    """Indices by descending value, ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def enumerate_nodes(children: Children, max_depth: int) -> list[tuple[tuple[float, tuple[int, ...]], tuple[int, ...], float, float]]:
    """Every node of finite score: (key, token path, score, logq), key = (-score, rank path)."""
    out = []

    def rec(tok_path, rank_path, score):
        if len(tok_path) == max_depth:
            return
        for r, (tok, lq) in enumerate(children(tok_path)):
            if lq == NEG_INF:
                continue
            s = score + lq
            out.append(((-s, rank_path + (r,)), tok_path + (tok,), s, lq))
            rec(tok_path + (tok,), rank_path + (r,), s)

    rec((), (), 0.0)
    return out


def nodes_to_lists(root: int, chosen) -> tuple[list[int], list[int], list[float], list[float]]:
    """Ordered nodes (key, token path, score, logq) -> tokens, parents, scores, draft log-probs."""
    index = {(): 0}
    tokens, parents, scores, dlps = [root], [-1], [0.0], [0.0]
    for n, (key, tok_path, s, lq) in enumerate(chosen, start=1):
        rank_path = key[1]
        index[rank_path] = n
        tokens.append(tok_path[-1])
        parents.append(index[rank_path[:-1]])  # KeyError = not ancestor-closed
        scores.append(s)
        dlps.append(lq)
    return tokens, parents, scores, dlps


def brute_best_first(root: int, children: Children, max_depth: int, budget: int):
    nodes = sorted(enumerate_nodes(children, max_depth), key=lambda x: x[0])
    return nodes_to_lists(root, nodes[:budget])


def tree_lists(t: Tree):
    return t.tokens.tolist(), t.parents.tolist(), t.scores.tolist(), t.draft_logprobs.tolist()


def assert_tree_invariants(t: Tree, budget: int, max_depth: int) -> None:
    n = t.num_nodes
    assert 1 <= n <= budget + 1
    Tree.from_parents(t.tokens, t.parents)  # topological order, root first (raises otherwise)
    assert t.tokens.dtype == torch.int64
    assert int(t.depth.max()) <= max_depth
    par, sc, dl = t.parents.tolist(), t.scores.tolist(), t.draft_logprobs.tolist()
    assert sc[0] == 0.0 and dl[0] == 0.0
    for i in range(1, n):
        assert sc[i] == sc[par[i]] + dl[i]  # path score = parent's + own log q
        assert dl[i] <= 0.0 and dl[i] > NEG_INF
    siblings = {}
    for i in range(1, n):
        siblings.setdefault(par[i], []).append(int(t.tokens[i]))
    for toks in siblings.values():
        assert len(toks) == len(set(toks))  # no duplicate child tokens


def best_closed_subset_mass(nodes, budget: int) -> float:
    """max over ancestor-closed node sets of size `budget` of sum exp(path score) (exhaustive)."""
    by_rank = {key[1]: s for key, _, s, _ in nodes}
    best = -1.0
    for combo in itertools.combinations(by_rank, min(budget, len(by_rank))):
        chosen = set(combo)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            best = max(best, sum(math.exp(by_rank[p]) for p in chosen))
    return best


def random_logprobs(shape, seed: int, ties: bool = False) -> torch.Tensor:
    """float64 log-probabilities; with ties, values from {0, -1, -2, -3, -inf} (sums stay exact)."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        choices = torch.tensor([0.0, -1.0, -2.0, -3.0, NEG_INF], dtype=torch.float64)
        return choices[torch.randint(0, 5, shape, generator=g)]
    return torch.randn(*shape, generator=g, dtype=torch.float64).mul(1.5).log_softmax(-1)


# --------------------------------------------------------------------------------------------
# chain
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget, max_depth", [(1, 4), (3, 4), (4, 4), (10, 4), (10, 2)])
def test_chain_is_argmax_per_depth(budget, max_depth):
    lp = random_logprobs((4, 5), seed=budget * 10 + max_depth)
    t = build_chain(3, lp, budget, max_depth)
    n = min(budget, max_depth)
    expected_tokens = [3] + [rank_order(lp[d].tolist())[0] for d in range(n)]
    assert t.tokens.tolist() == expected_tokens
    assert t.parents.tolist() == list(range(-1, n))
    assert t.draft_logprobs.tolist() == [0.0] + [lp[d, expected_tokens[d + 1]].item() for d in range(n)]
    assert_tree_invariants(t, budget, max_depth)
    assert t.scores.dtype == torch.float64


def test_chain_ties_take_lowest_token_and_stops_at_impossible_depth():
    lp = torch.tensor([[-1.0, -0.5, -0.5], [-0.25, -0.25, -3.0], [NEG_INF, NEG_INF, NEG_INF]])
    t = build_chain(0, lp, budget=3, max_depth=3)
    assert t.tokens.tolist() == [0, 1, 0]
    assert t.scores.tolist() == [0.0, -0.5, -0.75]
    assert t.scores.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# DDTree
# --------------------------------------------------------------------------------------------


def ddtree_children(lp: torch.Tensor) -> Children:
    rows = lp.tolist()

    def children(path):
        row = rows[len(path)]
        return [(t, row[t]) for t in rank_order(row)]

    return children


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("vocab, depth", [(2, 4), (3, 3), (5, 2), (4, 4)])
def test_ddtree_equals_brute_force_top_b(vocab, depth, ties):
    lp = random_logprobs((depth, vocab), seed=vocab * 100 + depth + 7 * ties, ties=ties)
    space = len(enumerate_nodes(ddtree_children(lp), depth))
    for budget in (1, 2, 5, 17, space - 1, space, space + 10):
        if budget < 1:
            continue
        t = build_ddtree(9, lp, budget, depth)
        assert tree_lists(t) == brute_best_first(9, ddtree_children(lp), depth, budget)
        assert t.num_nodes == 1 + min(budget, space)
        assert_tree_invariants(t, budget, depth)


def test_ddtree_boundary_ties_with_large_vocabulary_and_small_budget():
    # budget << V ranks only the best few tokens of each row; ties straddle that boundary
    lp = random_logprobs((2, 40), seed=77, ties=True)
    for budget in (1, 3, 9):
        assert tree_lists(build_ddtree(0, lp, budget, 2)) == brute_best_first(0, ddtree_children(lp), 2, budget)


@pytest.mark.parametrize("seed", range(3))
def test_ddtree_maximises_mass_over_ancestor_closed_sets(seed):
    lp = random_logprobs((3, 2), seed=seed)
    nodes = enumerate_nodes(ddtree_children(lp), 3)
    for budget in (1, 3, 5):
        t = build_ddtree(0, lp, budget, 3)
        got = t.scores[1:].exp().sum().item()
        assert got == pytest.approx(best_closed_subset_mass(nodes, budget), rel=1e-12, abs=0)


def test_ddtree_all_ties_hand_checked():
    lp = torch.full((2, 2), -1.0)
    t = build_ddtree(5, lp, budget=4, max_depth=2)
    # equal scores per depth: shallower first, then lexicographic rank path (lower token id)
    assert t.tokens.tolist() == [5, 0, 1, 0, 1]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1]
    assert t.scores.tolist() == [0.0, -1.0, -1.0, -2.0, -2.0]


def test_ddtree_whole_space_when_budget_exceeds_it():
    lp = random_logprobs((2, 2), seed=1)
    t = build_ddtree(0, lp, budget=1000, max_depth=2)
    assert t.num_nodes == 1 + 2 + 4
    paths = {tuple(t.tokens[t.path(i)[1:]].tolist()) for i in range(1, t.num_nodes)}
    assert paths == {(a,) for a in range(2)} | {(a, b) for a in range(2) for b in range(2)}


def test_ddtree_respects_max_depth_and_ignores_deeper_rows():
    lp = random_logprobs((4, 3), seed=3)
    t = build_ddtree(0, lp, budget=30, max_depth=2)
    assert int(t.depth.max()) == 2
    assert t.num_nodes == 1 + 3 + 9
    assert tree_lists(t) == tree_lists(build_ddtree(0, lp[:2].clone(), 30, 2))


def test_ddtree_is_deterministic():
    lp = random_logprobs((4, 5), seed=11, ties=True)
    a, b = build_ddtree(1, lp, 40, 4), build_ddtree(1, lp.clone(), 40, 4)
    assert tree_lists(a) == tree_lists(b)


# --------------------------------------------------------------------------------------------
# Weaver
# --------------------------------------------------------------------------------------------


class TableScorer:
    """A fixed conditional distribution over the K candidates given the realised token path.

    Checks the call protocol: root alone first, node ids increasing in creation order, parents
    passed before their children, at most `width` nodes, nothing at max_depth.
    """

    def __init__(self, root: int, candidates: torch.Tensor, table: dict, width: int, max_depth: int):
        self.root, self.cand, self.table = root, candidates, table
        self.width, self.max_depth = width, max_depth
        self.paths: dict[int, tuple[int, ...]] = {}
        self.depths: dict[int, int] = {}
        self.calls: list[list[int]] = []

    def __call__(self, node_ids, parent_ids, tokens, depths):
        for x in (node_ids, parent_ids, tokens, depths):
            assert x.dtype == torch.int64 and x.dim() == 1 and x.numel() == node_ids.numel()
        n = node_ids.numel()
        assert 1 <= n <= self.width
        ids = node_ids.tolist()
        if not self.calls:
            assert (ids, parent_ids.tolist(), tokens.tolist(), depths.tolist()) == ([0], [-1], [self.root], [0])
        rows = []
        last = max(self.paths, default=-1)
        for i, p, tok, d in zip(ids, parent_ids.tolist(), tokens.tolist(), depths.tolist()):
            assert i > last
            last = i
            assert d < self.max_depth
            if i == 0:
                path = ()
            else:
                assert p in self.paths and self.depths[p] == d - 1
                path = self.paths[p] + (tok,)
                assert tok in self.cand[d - 1].tolist()
            self.paths[i], self.depths[i] = path, d
            rows.append(self.table[path])
        self.calls.append(ids)
        return torch.tensor(rows, dtype=torch.float64)


def make_weaver_problem(k: int, depth: int, seed: int, ties: bool = False, vocab: int = 50):
    rng = random.Random(seed)
    candidates = torch.tensor([rng.sample(range(vocab), k) for _ in range(depth)], dtype=torch.long)
    table = {}
    lp = random_logprobs((sum(k**d for d in range(depth)), k), seed=seed, ties=ties).tolist()
    for d in range(depth):
        for cols in itertools.product(range(k), repeat=d):
            path = tuple(int(candidates[i, c]) for i, c in enumerate(cols))
            table[path] = lp.pop()
    return candidates, table


def weaver_children(candidates: torch.Tensor, table: dict, per_node: int) -> Children:
    cand = candidates.tolist()

    def children(path):
        row = table[path]
        return [(cand[len(path)][c], row[c]) for c in rank_order(row)[:per_node]]

    return children


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k, depth, per_node", [(2, 4, 8), (3, 3, 3), (4, 3, 2), (3, 4, 1)])
def test_weaver_width_one_equals_brute_force_top_b(k, depth, per_node, ties):
    candidates, table = make_weaver_problem(k, depth, seed=k * 10 + depth + per_node + 100 * ties, ties=ties)
    children = weaver_children(candidates, table, per_node)
    space = len(enumerate_nodes(children, depth))
    for budget in (1, 2, 6, space - 1, space, space + 5):
        if budget < 1:
            continue
        scorer = TableScorer(7, candidates, table, width=1, max_depth=depth)
        t = build_weaver(7, candidates, scorer, budget, depth, width=1, children_per_node=per_node)
        assert tree_lists(t) == brute_best_first(7, children, depth, budget)
        assert_tree_invariants(t, budget, depth)


@pytest.mark.parametrize("seed", range(3))
def test_weaver_width_one_maximises_mass_over_ancestor_closed_sets(seed):
    candidates, table = make_weaver_problem(2, 3, seed=seed)
    nodes = enumerate_nodes(weaver_children(candidates, table, 2), 3)
    for budget in (1, 3, 5):
        scorer = TableScorer(0, candidates, table, width=1, max_depth=3)
        t = build_weaver(0, candidates, scorer, budget, 3, width=1, children_per_node=8)
        assert t.scores[1:].exp().sum().item() == pytest.approx(best_closed_subset_mass(nodes, budget), rel=1e-12, abs=0)


def simulate_weaver_steps(root, candidates, table, budget, max_depth, width, per_node):
    """Batched best-first by recomputing the whole frontier from scratch at every step."""
    children = weaver_children(candidates, table, per_node)
    chosen = []  # (key, token path, score, logq) in creation order
    info = {(): ((), 0.0)}  # rank path -> (token path, score)
    expanded = [()]
    calls = 1
    while len(chosen) < budget:
        taken = {c[0][1] for c in chosen}
        frontier = []
        for rp in expanded:
            tok_path, score = info[rp]
            for r, (tok, lq) in enumerate(children(tok_path)):
                if lq != NEG_INF and rp + (r,) not in taken:
                    frontier.append(((-(score + lq), rp + (r,)), tok_path + (tok,), score + lq, lq))
        if not frontier:
            break
        frontier.sort(key=lambda x: x[0])
        batch = frontier[: min(width, budget - len(chosen))]
        chosen += batch
        for key, tok_path, s, _ in batch:
            info[key[1]] = (tok_path, s)
        if len(chosen) >= budget:
            break
        grow = [key[1] for key, tok_path, _, _ in batch if len(tok_path) < max_depth]
        if grow:
            calls += 1
            expanded += grow
    return nodes_to_lists(root, chosen), calls


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("width", [2, 3, 5])
@pytest.mark.parametrize("k, depth, per_node", [(3, 3, 8), (4, 3, 2), (2, 4, 2)])
def test_weaver_batched_steps_equal_step_simulation(k, depth, per_node, width, ties):
    candidates, table = make_weaver_problem(k, depth, seed=width * 1000 + k * 10 + depth + 7 * ties, ties=ties)
    for budget in (1, width, width + 1, 11, 40):
        scorer = TableScorer(3, candidates, table, width=width, max_depth=depth)
        t = build_weaver(3, candidates, scorer, budget, depth, width=width, children_per_node=per_node)
        expected, calls = simulate_weaver_steps(3, candidates, table, budget, depth, width, per_node)
        assert tree_lists(t) == expected
        assert len(scorer.calls) == calls
        assert_tree_invariants(t, budget, depth)


class CountingScorer:
    def __init__(self, k: int):
        self.k, self.sizes = k, []

    def __call__(self, node_ids, parent_ids, tokens, depths):
        self.sizes.append(node_ids.numel())
        return torch.arange(self.k, dtype=torch.float64).neg().expand(node_ids.numel(), self.k).log_softmax(-1)


@pytest.mark.parametrize("budget", [1, 5, 9, 10, 16, 33])
@pytest.mark.parametrize("width", [1, 3, 4, 16, 64])
def test_weaver_call_count_is_ceil_budget_over_width(budget, width):
    # children_per_node >= width keeps >= width entries in the frontier at every step, and max_depth
    # is deep enough never to bind: every materialised batch but the last is expanded.
    candidates = torch.arange(64 * 40, dtype=torch.long).view(40, 64)
    scorer = CountingScorer(64)
    t = build_weaver(99, candidates, scorer, budget, 40, width=width, children_per_node=64)
    assert t.num_nodes == 1 + budget
    assert len(scorer.sizes) == math.ceil(budget / width)
    assert scorer.sizes[0] == 1 and all(s == width for s in scorer.sizes[1:])


def test_weaver_width_at_least_budget_gives_only_root_children():
    candidates = torch.arange(12, dtype=torch.long).view(3, 4)
    scorer = CountingScorer(4)
    t = build_weaver(0, candidates, scorer, budget=3, max_depth=3, width=3)
    assert t.depth.tolist() == [0, 1, 1, 1]
    assert len(scorer.sizes) == 1


def test_weaver_never_expands_nodes_at_max_depth():
    candidates = torch.arange(12, dtype=torch.long).view(3, 4)
    scorer = CountingScorer(4)
    t = build_weaver(0, candidates, scorer, budget=10, max_depth=1, width=2)
    assert t.num_nodes == 1 + 4 and t.depth.tolist() == [0, 1, 1, 1, 1]
    assert scorer.sizes == [1]  # depth-1 nodes are at max_depth: no further call


def test_weaver_with_path_independent_scorer_equals_ddtree():
    lp = random_logprobs((3, 4), seed=5)
    candidates = torch.arange(4, dtype=torch.long).expand(3, 4).contiguous()
    scorer = lambda ids, par, tok, dep: lp[dep]  # noqa: E731
    for budget in (1, 7, 30, 84, 100):
        t = build_weaver(2, candidates, scorer, budget, 3, width=1, children_per_node=4)
        assert tree_lists(t) == tree_lists(build_ddtree(2, lp, budget, 3))


def test_weaver_is_deterministic():
    candidates, table = make_weaver_problem(3, 3, seed=4, ties=True)
    a = build_weaver(1, candidates, TableScorer(1, candidates, table, 2, 3), 20, 3, width=2, children_per_node=3)
    b = build_weaver(1, candidates, TableScorer(1, candidates, table, 2, 3), 20, 3, width=2, children_per_node=3)
    assert tree_lists(a) == tree_lists(b)


def test_default_weaver_width():
    budgets = (1, 8, 9, 16, 17, 24, 25, 32, 64, 65, 128)
    assert [default_weaver_width(b) for b in budgets] == [1, 1, 2, 2, 3, 3, 4, 4, 4, 5, 8]
    with pytest.raises(ValueError, match="budget"):
        default_weaver_width(0)


# --------------------------------------------------------------------------------------------
# TreeFlash
# --------------------------------------------------------------------------------------------


class TransitionTable:
    """transition_scorer returning a fixed table row per (depth, previous token); checks calls."""

    def __init__(self, root: int, marginals: torch.Tensor, rows: dict, top_m: int, max_depth: int):
        self.root, self.marginals, self.rows = root, marginals, rows
        self.top_m, self.max_depth = top_m, max_depth
        self.calls: list[tuple[int, list[int]]] = []

    def stage1(self, d: int) -> list[int]:
        return rank_order(self.marginals[d - 1].tolist())[: self.top_m]

    def __call__(self, d: int, prev: torch.Tensor) -> torch.Tensor:
        assert prev.dtype == torch.int64
        assert d == len(self.calls) + 1 and d <= self.max_depth
        expected_prev = [self.root] if d == 1 else self.stage1(d - 1)
        assert prev.tolist() == expected_prev
        self.calls.append((d, prev.tolist()))
        return torch.tensor([self.rows[(d, p)] for p in prev.tolist()], dtype=torch.float64)


def make_treeflash_problem(vocab: int, depth: int, seed: int, ties: bool = False):
    marg = random_logprobs((depth, vocab), seed=seed, ties=ties)
    trans = random_logprobs((depth * vocab + 1, vocab), seed=seed + 1, ties=ties).tolist()
    rows = {}
    for d in range(1, depth + 1):
        for p in range(vocab):
            rows[(d, p)] = trans.pop()
    return marg, rows


def treeflash_children(root: int, marg: torch.Tensor, rows: dict, top_m: int, max_depth: int) -> Children:
    stage1 = [set(rank_order(marg[d - 1].tolist())[:top_m]) for d in range(1, max_depth + 1)]

    def children(path):
        d = len(path)  # depth of the parent
        if d >= 1 and path[-1] not in stage1[d - 1]:
            return []  # the transition cannot continue: not a stage-1 candidate of its depth
        row = rows[(d + 1, path[-1] if path else root)]
        return [(t, row[t]) for t in rank_order(row)[:top_m]]

    return children


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("vocab, depth, top_m", [(4, 3, 2), (5, 3, 3), (3, 4, 2), (5, 2, 5), (4, 4, 1)])
def test_treeflash_equals_brute_force_on_restricted_graph(vocab, depth, top_m, ties):
    root = 1
    marg, rows = make_treeflash_problem(vocab, depth, seed=vocab * 100 + depth * 10 + top_m + 1000 * ties, ties=ties)
    rows[(1, root)] = rows[(1, 0)]
    children = treeflash_children(root, marg, rows, top_m, depth)
    space = len(enumerate_nodes(children, depth))
    for budget in (1, 3, 8, space - 1, space, space + 4):
        if budget < 1:
            continue
        scorer = TransitionTable(root, marg, rows, top_m, depth)
        t = build_treeflash(root, marg, scorer, budget, depth, top_m=top_m)
        assert tree_lists(t) == brute_best_first(root, children, depth, budget)
        assert [c[0] for c in scorer.calls] == list(range(1, depth + 1))
        assert_tree_invariants(t, budget, depth)


def test_treeflash_restriction_is_binding_on_a_hand_built_case():
    # V = 3, root token 7. Stage 1 at depth 1 ranks tokens 2, 0, 1 (0 and 1 tie: 0 first).
    marg = torch.log(torch.tensor([[0.2, 0.2, 0.6], [0.5, 0.25, 0.25]], dtype=torch.float64))
    probs = {
        (1, 7): [0.5, 0.1, 0.4],  # root transitions rank 0, 2, 1
        (2, 2): [0.125, 0.75, 0.125],  # after token 2: 1, then 0 (tie with 2)
        (2, 0): [0.25, 0.25, 0.5],  # after token 0: 2, then 0 (tie with 1)
    }
    rows = {key: [math.log(p) for p in val] for key, val in probs.items()}
    scorer = lambda d, prev: torch.tensor([rows[(d, p)] for p in prev.tolist()], dtype=torch.float64)  # noqa: E731
    # M = 1: the root keeps token 0 only, which is not the stage-1 candidate of depth 1 (token 2):
    # a dead end, so the tree stops there although the budget allows more.
    t = build_treeflash(7, marg, scorer, budget=5, max_depth=2, top_m=1)
    assert t.tokens.tolist() == [7, 0] and t.parents.tolist() == [-1, 0]
    # M = 2: root keeps 0 (0.5) and 2 (0.4), both in S_1 = [2, 0]; path probabilities:
    # 0: .5, 2: .4, 2->1: .3, 0->2: .25, 0->0: .125, 2->0: .05
    t2 = build_treeflash(7, marg, scorer, budget=10, max_depth=2, top_m=2)
    assert t2.tokens.tolist() == [7, 0, 2, 1, 2, 0, 0]
    assert t2.parents.tolist() == [-1, 0, 0, 2, 1, 1, 2]
    assert t2.scores.exp().tolist() == pytest.approx([1.0, 0.5, 0.4, 0.3, 0.25, 0.125, 0.05], abs=1e-15)


def test_treeflash_with_prev_independent_transitions_and_full_m_equals_ddtree():
    lp = random_logprobs((3, 4), seed=8)
    scorer = lambda d, prev: lp[d - 1].expand(prev.numel(), 4)  # noqa: E731
    for budget in (1, 6, 50, 84, 90):
        t = build_treeflash(0, lp, scorer, budget, 3, top_m=4)
        assert tree_lists(t) == tree_lists(build_ddtree(0, lp, budget, 3))


@pytest.mark.parametrize("seed", range(2))
def test_treeflash_maximises_mass_over_ancestor_closed_sets(seed):
    marg, rows = make_treeflash_problem(3, 3, seed=seed)
    children = treeflash_children(0, marg, rows, 2, 3)
    nodes = enumerate_nodes(children, 3)
    for budget in (2, 4):
        t = build_treeflash(0, marg, TransitionTable(0, marg, rows, 2, 3), budget, 3, top_m=2)
        assert t.scores[1:].exp().sum().item() == pytest.approx(best_closed_subset_mass(nodes, budget), rel=1e-12, abs=0)


# --------------------------------------------------------------------------------------------
# batched wrappers
# --------------------------------------------------------------------------------------------


def assert_batch_matches(batch: TreeBatch, trees: list[Tree]) -> None:
    assert batch.num_requests == len(trees)
    assert batch.cu_nodes.tolist() == [0] + list(itertools.accumulate(t.num_nodes for t in trees))
    for got, want in zip(batch.trees(), trees):
        assert tree_lists(got) == tree_lists(want)
        assert got.depth.tolist() == want.depth.tolist()


def test_batched_builders_equal_per_request_builds():
    lp = random_logprobs((3, 4, 5), seed=21)
    roots = torch.tensor([4, 0, 2])
    budgets, depths = [1, 6, 13], [4, 2, 3]
    assert_batch_matches(build_chain_batch(roots, lp, budgets, depths),
                         [build_chain(int(roots[i]), lp[i], budgets[i], depths[i]) for i in range(3)])
    assert_batch_matches(build_ddtree_batch(roots, lp, 7, 4),
                         [build_ddtree(int(roots[i]), lp[i], 7, 4) for i in range(3)])
    tf_scorers = [lambda d, prev, i=i: lp[i, d - 1].expand(prev.numel(), 5) for i in range(3)]
    assert_batch_matches(build_treeflash_batch(roots, lp, tf_scorers, budgets, 3, top_m=2),
                         [build_treeflash(int(roots[i]), lp[i], tf_scorers[i], budgets[i], 3, top_m=2) for i in range(3)])
    cands = torch.stack([make_weaver_problem(3, 3, seed=s)[0] for s in range(3)])
    tables = [make_weaver_problem(3, 3, seed=s)[1] for s in range(3)]
    scorers = [TableScorer(int(roots[i]), cands[i], tables[i], 2, 3) for i in range(3)]
    batch = build_weaver_batch(roots, cands, scorers, budgets, 3, 2, children_per_node=2)
    fresh = [TableScorer(int(roots[i]), cands[i], tables[i], 2, 3) for i in range(3)]
    assert_batch_matches(batch, [build_weaver(int(roots[i]), cands[i], fresh[i], budgets[i], 3, 2, 2) for i in range(3)])


# --------------------------------------------------------------------------------------------
# invalid arguments
# --------------------------------------------------------------------------------------------

LP = torch.zeros(3, 4, dtype=torch.float64).log_softmax(-1)
CANDS = torch.arange(12, dtype=torch.long).view(3, 4)
W_SCORER = CountingScorer(4)
T_SCORER = lambda d, prev: LP[d - 1].expand(prev.numel(), 4)  # noqa: E731

ALL_BUILDERS = {
    "chain": lambda **kw: build_chain(kw.get("root", 0), kw.get("lp", LP), kw.get("budget", 4), kw.get("max_depth", 3)),
    "ddtree": lambda **kw: build_ddtree(kw.get("root", 0), kw.get("lp", LP), kw.get("budget", 4), kw.get("max_depth", 3)),
    "treeflash": lambda **kw: build_treeflash(kw.get("root", 0), kw.get("lp", LP), T_SCORER, kw.get("budget", 4),
                                              kw.get("max_depth", 3)),
}


@pytest.mark.parametrize("name", sorted(ALL_BUILDERS))
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget": 0}, "budget must be >= 1, got 0"),
        ({"budget": -3}, "budget must be >= 1, got -3"),
        ({"budget": 2.5}, "budget must be an integer >= 1, got 2.5"),
        ({"budget": True}, "budget must be an integer >= 1, got True"),
        ({"max_depth": 0}, "max_depth must be >= 1, got 0"),
        ({"max_depth": 4}, "marginal_logprobs has 3 depth rows but max_depth is 4"),
        ({"root": -1}, "root_token must be >= 0, got -1"),
        ({"lp": torch.zeros(4)}, r"marginal_logprobs must have shape \[D, V\], got shape \(4,\)"),
        ({"lp": torch.zeros(1, 3, 4)}, r"marginal_logprobs must have shape \[D, V\], got shape \(1, 3, 4\)"),
        ({"lp": torch.zeros(3, 0)}, "marginal_logprobs must not be empty"),
        ({"lp": torch.zeros(3, 4, dtype=torch.long)}, "must be a floating tensor of log-probabilities"),
        ({"lp": torch.tensor([[0.0, float("nan")]] * 3)}, "marginal_logprobs contains NaN"),
        ({"lp": torch.tensor([[0.5, -1.0]] * 3)}, r"must be log-probabilities \(<= 0\), got max 0.5"),
    ],
)
def test_marginal_builders_reject_invalid_arguments(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ALL_BUILDERS[name](**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget": 0}, "budget must be >= 1, got 0"),
        ({"width": 0}, "width must be >= 1, got 0"),
        ({"children_per_node": 0}, "children_per_node must be >= 1, got 0"),
        ({"max_depth": 4}, "candidates has 3 depth rows but max_depth is 4"),
        ({"candidates": CANDS.float()}, "candidates must be int64 token ids"),
        ({"candidates": CANDS[0]}, r"candidates must be an int64 tensor of shape \[D, K\], got shape \(4,\)"),
        ({"candidates": torch.tensor([[1, 2], [3, 3], [4, 5]])}, "candidates of depth 2 contain a repeated token id"),
        ({"candidates": torch.tensor([[1, -2], [3, 4], [4, 5]])}, "candidates must be token ids >= 0"),
        ({"scorer": lambda *a: torch.zeros(1, 3)}, r"scorer output \(call 1, 1 nodes\) must have shape \[1, 4\], got \(1, 3\)"),
        ({"scorer": lambda *a: torch.ones(1, 4)}, r"must be log-probabilities \(<= 0\)"),
        ({"scorer": lambda *a: [0.0] * 4}, r"must have shape \[1, 4\], got list"),
    ],
)
def test_weaver_rejects_invalid_arguments(kwargs, match):
    args = {"root_token": 0, "candidates": CANDS, "scorer": W_SCORER, "budget": 4, "max_depth": 3, "width": 2,
            "children_per_node": 8}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_weaver(**args)


def test_treeflash_rejects_invalid_arguments():
    with pytest.raises(ValueError, match="top_m must be >= 1, got 0"):
        build_treeflash(0, LP, T_SCORER, 4, 3, top_m=0)
    with pytest.raises(ValueError, match=r"transition_scorer output at depth 2 must have shape \[2, 4\], got \(2, 3\)"):
        build_treeflash(0, LP, lambda d, prev: LP[d - 1, :3 if d == 2 else 4].expand(prev.numel(), -1), 4, 3, top_m=2)
    with pytest.raises(ValueError, match="transition_scorer output at depth 1 contains NaN"):
        build_treeflash(0, LP, lambda d, prev: torch.full((prev.numel(), 4), float("nan")), 4, 3)


def test_batched_builders_reject_mismatched_requests():
    lp = LP.expand(2, 3, 4)
    with pytest.raises(ValueError, match="root_tokens has 3 entries for 2 requests"):
        build_ddtree_batch([0, 1, 2], lp, 4, 3)
    with pytest.raises(ValueError, match="budget has 1 entries for 2 requests"):
        build_chain_batch([0, 1], lp, [4], 3)
    with pytest.raises(ValueError, match=r"budget\[1\] must be >= 1, got 0"):
        build_ddtree_batch([0, 1], lp, [4, 0], 3)
    with pytest.raises(ValueError, match=r"marginal_logprobs must have shape \[R, D, V\], got shape \(3, 4\)"):
        build_ddtree_batch([0], LP, 4, 3)
    with pytest.raises(ValueError, match="scorers has 1 entries for 2 requests"):
        build_weaver_batch([0, 1], CANDS.expand(2, 3, 4), [W_SCORER], 4, 3, 2)
    with pytest.raises(ValueError, match="transition_scorers has 3 entries for 2 requests"):
        build_treeflash_batch([0, 1], lp, [T_SCORER] * 3, 4, 3)

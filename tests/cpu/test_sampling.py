"""Tree acceptance: greedy vs brute force, and exact output distributions of the stochastic
verifiers, integrated exactly over their uniforms (float64, tiny vocabularies).

Losslessness is checked as "one verify step, then continue with the target, is the target": for
every emitted sequence s (accepted path tokens then the bonus) extend it to a fixed horizon H with
the target's conditionals; the resulting law on V^H must equal the product of the target's
conditionals (and, in particular, the first emitted token has law p(. | root)). The target is a
fixed random conditional table p(x | prefix); the verifier sees p at every node through the
node's prefix.

Exact integration over the uniforms (each decision reads one uniform through an inverse CDF, so the
outcome is piecewise constant in each uniform):

* target-only: the tables are dyadic (every probability a multiple of 1/den), so every threshold
  of every decision is a multiple of 1/den, exactly representable. The outcome is then constant on
  each cell [k/den, (k+1)/den) of every column, and averaging it over the cell midpoints of the
  full grid is the exact integral. This uses nothing of the verifier beyond its uniform layout.
* traversal and the tree sampler: thresholds (acceptance probabilities, residual CDFs) are not on
  any grid. A straightforward recursive reference written here (scalar Python, no shared code)
  yields, through a replay enumerator, every decision path with the interval of each uniform it
  consumed; the path's weight is the product of the interval lengths. The verifier is evaluated at
  the interval midpoints and must agree with the reference there and at both ends of every
  interval (1e-12 inside), so its outcome is constant on the pieces being weighted: the integral
  of the verifier's own outputs is exact up to breakpoint shifts below 1e-12. A bug shared by the
  reference and the verifier still fails the distribution check, one in either alone fails the
  agreement check.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from _trees import random_tree_parents
from vllm_tfm.tree.types import TreeBatch, depths_from_parents
from vllm_tfm.verify.accept_result import accept_result_from_last_node
from vllm_tfm.verify.logits_processing import TreeSamplingParams, process_logits
from vllm_tfm.verify.sampling import (
    AcceptResult,
    sample_tree_from_draft,
    uniform_width,
    verify_greedy,
    verify_target_only,
    verify_traversal,
    verify_tree,
)

TOL = 1e-9
PROBE = 1e-12
F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# conditional tables and the losslessness check


class Table:
    """A fixed random conditional table x -> p(x | prefix) over prefixes (tuples, root first).

    den: probabilities are multiples of 1/den (dyadic tables for grid integration; some entries
    are zero), else peaky continuous values with one zero entry per row if ``zero``.
    """

    def __init__(self, vocab: int, seed: int, den: int | None = None, zero: bool = True):
        self.vocab, self.seed, self.den, self.zero = vocab, seed, den, zero
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._cache:
            g = torch.Generator().manual_seed(hash((self.seed,) + prefix) % (2**31))
            if self.den is not None:
                cuts = torch.randint(0, self.den + 1, (self.vocab - 1,), generator=g).sort().values
                counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([self.den])]))
                p = counts.to(F64) / self.den
            else:
                w = torch.rand(self.vocab, generator=g, dtype=F64) ** 3
                if self.zero:
                    w[torch.randint(0, self.vocab, (1,), generator=g)] = 0.0
                p = w / w.sum()
            self._cache[prefix] = p
        return self._cache[prefix]


def path_tokens(tokens: list[int], parents: list[int], node: int) -> tuple[int, ...]:
    out = []
    while node >= 0:
        out.append(tokens[node])
        node = parents[node]
    return tuple(out[::-1])


def node_rows(tokens: list[int], parents: list[int], table: Table) -> torch.Tensor:
    """[n, V]: row i = table(prefix root..i)."""
    return torch.stack([table(path_tokens(tokens, parents, i)) for i in range(len(tokens))])


def assert_lossless(emitted: dict[tuple[int, ...], float], table: Table, root: int, horizon: int) -> None:
    """The emitted-sequence law, completed to ``horizon`` tokens with the target, is the target."""
    total = sum(emitted.values())
    assert abs(total - 1) < TOL, f"emitted probabilities sum to {total}"
    first = defaultdict(float)
    for s, w in emitted.items():
        first[s[0]] += w
    p0 = table((root,))
    for x in range(table.vocab):
        assert abs(first[x] - float(p0[x])) < TOL, f"first token {x}: {first[x]} vs target {float(p0[x])}"
    completed: dict[tuple[int, ...], float] = defaultdict(float)

    def extend(seq: tuple[int, ...], w: float) -> None:
        if len(seq) == horizon:
            completed[seq] += w
            return
        p = table((root,) + seq).tolist()
        for x, px in enumerate(p):
            if px > 0:
                extend(seq + (x,), w * px)

    for s, w in emitted.items():
        assert 1 <= len(s) <= horizon, f"emitted sequence {s} longer than the horizon {horizon}"
        extend(s, w)
    target: dict[tuple[int, ...], float] = defaultdict(float)
    extend_target = [((), 1.0)]
    while extend_target:
        seq, w = extend_target.pop()
        if len(seq) == horizon:
            target[seq] += w
            continue
        for x, px in enumerate(table((root,) + seq).tolist()):
            if px > 0:
                extend_target.append((seq + (x,), w * px))
    worst = max(abs(completed[k] - target[k]) for k in set(completed) | set(target))
    assert worst < TOL, f"completed emitted law differs from the target by {worst:.3e}"


def emitted_of(res: AcceptResult, row: int) -> tuple[int, ...]:
    n = int(res.num_accepted[row])
    return tuple(res.output_tokens[row, : n + 1].tolist())


# ----------------------------------------------------------------------------------------------
# batches


def make_batch(cases: list[tuple[list[int], list[int], list[float] | None]]) -> TreeBatch:
    """Ragged batch from (tokens, parents, draft_logprobs or None) per request, built in one go."""
    tokens, parents, depth, dl, counts = [], [], [], [], []
    for tok, par, logq in cases:
        tokens += tok
        parents += par
        depth += depths_from_parents(torch.tensor(par)).tolist()
        dl += logq if logq is not None else [0.0] * len(tok)
        counts.append(len(tok))
    cu = torch.zeros(len(cases) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(counts).cumsum(0)
    has_dl = all(c[2] is not None for c in cases)
    return TreeBatch(
        torch.tensor(tokens),
        torch.tensor(parents),
        torch.tensor(depth),
        cu,
        torch.tensor(dl, dtype=F64) if has_dl else None,
    )


# ----------------------------------------------------------------------------------------------
# exact integration on a dyadic grid (target-only)


def grid_distributions(
    sampler: Callable[[torch.Tensor, TreeBatch, torch.Tensor], AcceptResult],
    cases: list[tuple[list[int], list[int], Table]],
    den: int | None = None,
) -> list[dict[tuple[int, ...], float]]:
    """Emitted-sequence law of each case (tokens, parents, dyadic table), all in one batched call.

    The grid has ``den`` cells per column (default: the table's denominator); exact when every
    threshold of the sampler is a multiple of 1/den.
    """
    batch_cases, prob_rows, uni_rows, owner = [], [], [], []
    for c, (tok, par, table) in enumerate(cases):
        cols = max(depths_from_parents(torch.tensor(par)).tolist()) + 1
        cells = den or table.den
        mids = (torch.arange(cells, dtype=F64) + 0.5) / cells
        grid = torch.cartesian_prod(*[mids] * cols).reshape(-1, cols)
        rows = node_rows(tok, par, table)
        for g in grid:
            batch_cases.append((tok, par, None))
            prob_rows.append(rows)
            uni_rows.append(g)
            owner.append((c, 1.0 / grid.shape[0]))
    trees = make_batch(batch_cases)
    width = int(trees.depth.max()) + 1
    uniforms = torch.full((len(uni_rows), width), 0.5, dtype=F64)
    for r, g in enumerate(uni_rows):
        uniforms[r, : g.numel()] = g  # columns past a tree's depth are never read
    res = sampler(torch.cat(prob_rows), trees, uniforms)
    check_contract(res, trees)
    out: list[dict] = [defaultdict(float) for _ in cases]
    for r, (c, w) in enumerate(owner):
        out[c][emitted_of(res, r)] += w
    return out


# ----------------------------------------------------------------------------------------------
# replay enumeration of decision paths (traversal, tree sampler)


class _Branch(Exception):
    def __init__(self, options: list[int]):
        self.options = options


class Source:
    """Uniform source for a reference program: ``draw(column, weights)`` is an inverse CDF.

    Scripted choices replay a decision path; at the first unscripted draw the enumerator branches
    over the outcomes with positive weight. Each draw records (column, lo, hi): the outcome's
    interval of that column's uniform.
    """

    def __init__(self, script: list[int]):
        self.script = script
        self.draws: list[tuple[int, float, float]] = []

    def draw(self, column: int, weights: list[float]) -> int:
        total = sum(weights)
        edges, acc = [0.0], 0.0
        for w in weights:
            acc += w
            edges.append(acc / total)
        options = [k for k, w in enumerate(weights) if w > 0]
        i = len(self.draws)
        if i == len(self.script):
            raise _Branch(options)
        k = self.script[i]
        hi = 1.0 if k == options[-1] else edges[k + 1]  # past the total, the last positive entry
        self.draws.append((column, edges[k], hi))
        return k


def enumerate_paths(program: Callable[[Source], object]) -> list[tuple[list[tuple[int, float, float]], object]]:
    leaves, stack = [], [[]]
    while stack:
        script = stack.pop()
        src = Source(script)
        try:
            out = program(src)
        except _Branch as b:
            stack.extend(script + [k] for k in b.options)
            continue
        cols = [c for c, _, _ in src.draws]
        assert len(cols) == len(set(cols)), f"a column was read twice on one decision path: {cols}"
        leaves.append((src.draws, out))
    return leaves


def probe_rows(draws: list[tuple[int, float, float]], width: int) -> list[torch.Tensor]:
    """Midpoint row first, then rows with one column moved to each end of its interval."""
    mid = torch.full((width,), 0.5, dtype=F64)
    for c, lo, hi in draws:
        mid[c] = (lo + hi) / 2
    rows = [mid]
    for c, lo, hi in draws:
        if hi - lo > 4 * PROBE:
            for end in (lo + PROBE, hi - PROBE):
                r = mid.clone()
                r[c] = end
                rows.append(r)
    return rows


# ----------------------------------------------------------------------------------------------
# traversal reference (recursive, scalar; independent of the package)


def reference_traversal(
    src: Source,
    tokens: list[int],
    parents: list[int],
    p_rows: list[list[float]],
    q_rows: list[list[float]],
    width_nodes: int,
    shuffle: bool,
    bug: str | None = None,
) -> tuple[int, tuple[int, ...]]:
    """Traversal Verification as a recursion over subtrees; returns (last node, emitted tokens).

    Column layout of vllm_tfm.verify.traversal: 0 bonus, 1 + t the t-th visit, 1 + N + c the
    sibling-order draw at child slot c. ``bug`` switches off one update (for the teeth tests).
    """
    n, vocab = len(tokens), len(p_rows[0])
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    if shuffle:
        for v in range(n):
            if len(children[v]) > 1:
                remaining, placed = list(children[v]), []
                for c in children[v][:-1]:
                    k = src.draw(1 + width_nodes + c, [q_rows[v][tokens[x]] for x in remaining])
                    placed.append(remaining.pop(k))
                children[v] = placed + remaining
    visits = [0]

    def subtree(v: int, alpha: float, p: list[float], q: list[float]) -> tuple[int, list[float]] | None:
        for c in children[v]:
            x = tokens[c]
            a_c = min(alpha * p[x] / q[x], 1.0) if q[x] > 0 else float(alpha * p[x] > 0)
            got = subtree(c, a_c, list(p_rows[c]), list(q_rows[c]))
            if got is not None:
                return got
            residual = [max(alpha * p[y] - q[y], 0.0) for y in range(vocab)]
            mass = sum(residual)
            if bug != "keep_target" and mass > 0:
                p = [r / mass for r in residual]
            if bug != "keep_draft":
                q = [0.0 if y == x else q[y] for y in range(vocab)]
                s = sum(q)
                q = [v_ / s for v_ in q] if s > 0 else q
            if bug != "keep_alpha":
                alpha = 1.0 if alpha >= 1 else mass / (mass + 1 - alpha)
        t = visits[0]
        visits[0] += 1
        if src.draw(1 + t, [alpha, 1 - alpha]) == 0:
            return v, p
        return None

    node, p_final = subtree(0, 1.0, list(p_rows[0]), list(q_rows[0]))
    bonus = src.draw(0, p_final)
    return node, path_tokens(tokens, parents, node)[1:] + (bonus,)


def sibling_softmax_rows(tokens: list[int], parents: list[int], logq: list[float], vocab: int) -> list[list[float]]:
    rows = [[0.0] * vocab for _ in tokens]
    for v in range(len(tokens)):
        ch = [c for c in range(1, len(tokens)) if parents[c] == v]
        z = sum(math.exp(logq[c]) for c in ch)
        for c in ch:
            rows[v][tokens[c]] = math.exp(logq[c]) / z
    return rows


def traversal_distributions(
    cases: list[tuple[object, list[int], list[int], torch.Tensor, torch.Tensor | None, list[float] | None, float]],
    bug: str | None = None,
    run_verifier: bool = True,
) -> dict[object, dict[tuple[int, ...], float]]:
    """Law of the emitted sequence per group, from cases (group, tokens, parents, p_rows, q_rows,
    logq, weight) verified in one ragged batch; a group's law is the weighted sum of its cases.

    q_rows given: drafter mode (draft_probs); else sibling mode from logq. All cases share the
    mode. With run_verifier the verifier's outputs are integrated (after checking them against
    the reference at every midpoint and interval end); otherwise the reference's own.
    """
    shuffle = cases[0][4] is None
    width_nodes = max(len(c[1]) for c in cases)
    width = 1 + 2 * width_nodes
    batch_cases, p_batch, q_batch, uni, expect = [], [], [], [], []
    for group, tok, par, p_rows, q_rows, logq, case_w in cases:
        vocab = p_rows.shape[1]
        q_list = sibling_softmax_rows(tok, par, logq, vocab) if shuffle else q_rows.tolist()
        p_list = p_rows.tolist()
        leaves = enumerate_paths(
            lambda src: reference_traversal(src, tok, par, p_list, q_list, width_nodes, shuffle, bug)
        )
        for draws, out in leaves:
            w = case_w * math.prod(hi - lo for _, lo, hi in draws)
            rows = probe_rows(draws, width)
            for j, r in enumerate(rows):
                batch_cases.append((tok, par, logq))
                p_batch.append(p_rows)
                if not shuffle:
                    q_batch.append(q_rows)
                uni.append(r)
                expect.append((group, out, w if j == 0 else 0.0))
    dists: dict[object, dict] = defaultdict(lambda: defaultdict(float))
    if not run_verifier:
        for group, (node, emitted), w in expect:
            dists[group][emitted] += w
        return dists
    trees = make_batch(batch_cases)
    res = verify_traversal(
        torch.cat(p_batch), trees, None if shuffle else torch.cat(q_batch), uniforms=torch.stack(uni)
    )
    check_contract(res, trees)
    last = res.last_node.tolist()
    for r, (group, (node, emitted), w) in enumerate(expect):
        got = (last[r], emitted_of(res, r))
        assert got == (node, emitted), f"row {r}: verifier gives {got}, reference {(node, emitted)}"
        dists[group][emitted] += w
    return dists


# ----------------------------------------------------------------------------------------------
# AcceptResult contract


def check_contract(res: AcceptResult, trees: TreeBatch) -> None:
    """accepted_nodes / num_accepted / last_node / bonus / output_tokens agree with the trees."""
    dmax = int(trees.depth.max())
    num_req = trees.num_requests
    assert res.accepted_nodes.shape == (num_req, dmax)
    assert res.output_tokens.shape == (num_req, dmax + 1)
    cu = trees.cu_nodes.tolist()
    tok, par = trees.tokens.tolist(), trees.parents.tolist()
    acc, out = res.accepted_nodes.tolist(), res.output_tokens.tolist()
    per_request = zip(res.num_accepted.tolist(), res.last_node.tolist(), res.bonus.tolist())
    for r, (n_acc, last, bonus) in enumerate(per_request):
        s = cu[r]
        path = []
        v = last
        while v > 0:
            path.append(v)
            v = par[s + v]
        path = path[::-1]
        assert 0 <= last < cu[r + 1] - s and n_acc == len(path)
        assert acc[r] == path + [-1] * (dmax - n_acc)
        assert out[r] == [tok[s + v] for v in path] + [bonus] + [-1] * (dmax - n_acc)


# ----------------------------------------------------------------------------------------------
# greedy


def greedy_table(vocab: int, seed: int) -> Callable[[tuple[int, ...]], torch.Tensor]:
    cache: dict = {}

    def logits(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            g = torch.Generator().manual_seed(hash((seed,) + prefix) % (2**31))
            cache[prefix] = torch.randn(vocab, generator=g, dtype=F64)
        return cache[prefix]

    return logits


def test_greedy_matches_brute_force_and_greedy_decoding():
    vocab = 5
    gen = torch.Generator().manual_seed(0)
    trees, logit_rows, expected = [], [], []
    for r in range(12):
        table = greedy_table(vocab, seed=r)
        n = int(torch.randint(1, 12, (1,), generator=gen))
        parents = random_tree_parents(n, gen, kind=("random", "chain", "deep")[r % 3]).tolist()
        tokens = [int(torch.randint(0, vocab, (1,), generator=gen))]
        for i in range(1, n):  # half the nodes continue the greedy chain, siblings distinct
            greedy_tok = int(table(path_tokens(tokens, parents, parents[i])).argmax())
            taken = {tokens[c] for c in range(1, i) if parents[c] == parents[i]}
            choices = [x for x in range(vocab) if x not in taken]
            x = greedy_tok if greedy_tok in choices and float(torch.rand((), generator=gen)) < 0.6 else None
            tokens.append(x if x is not None else choices[int(torch.randint(0, len(choices), (1,), generator=gen))])
        # brute force: the deepest node whose path tokens are the greedy continuation
        best = 0
        for i in range(n):
            toks = path_tokens(tokens, parents, i)
            if all(toks[k + 1] == int(table(toks[: k + 1]).argmax()) for k in range(len(toks) - 1)):
                best = i if len(toks) > len(path_tokens(tokens, parents, best)) else best
        # greedy decoding from the root, as many tokens as the accepted path plus the bonus
        seq = (tokens[0],)
        for _ in range(len(path_tokens(tokens, parents, best))):
            seq += (int(table(seq).argmax()),)
        trees.append((tokens, parents, None))
        logit_rows.append(torch.stack([table(path_tokens(tokens, parents, i)) for i in range(n)]))
        expected.append((best, seq[1:]))
    batch = make_batch(trees)
    res = verify_greedy(torch.cat(logit_rows), batch)
    check_contract(res, batch)
    for r, (best, seq) in enumerate(expected):
        assert int(res.last_node[r]) == best
        assert emitted_of(res, r) == seq
    assert sum(int(res.num_accepted[r]) > 0 for r in range(len(expected))) >= 6


def test_greedy_ties_and_duplicate_children():
    # root logits tie between tokens 1 and 3: argmax is 1. Root children: 3, 1 (node 2), 1 (node 3).
    tokens, parents = [0, 3, 1, 1, 2], [-1, 0, 0, 0, 3]
    logits = torch.zeros(5, 4, dtype=F64)
    logits[0] = torch.tensor([0.0, 2.0, 0.5, 2.0])
    logits[2] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    logits[3] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # node 3 has the matching child, but node 2 is first
    res = verify_greedy(logits, make_batch([(tokens, parents, None)]))
    assert res.last_node.tolist() == [2] and res.output_tokens.tolist() == [[1, 3, -1]]


# ----------------------------------------------------------------------------------------------
# target-only: exact distributions


def tree_chain_star_deep(vocab: int) -> list[tuple[list[int], list[int]]]:
    return [
        ([0, 1, 2, 3], [-1, 0, 1, 2]),  # chain of 3 drafts
        ([2, 0, 1, 3], [-1, 0, 0, 0]),  # star: every token but the root's own below the root
        ([1, 2, 0, 2, 1, 3, 0, 2], [-1, 0, 0, 0, 1, 1, 4, 3]),  # depth 3, duplicate 2 under the root
        ([3], [-1]),  # root only
    ]


def test_target_only_exact_on_chains_stars_and_trees_with_duplicates():
    vocab = 4
    cases = []
    for k, (tok, par) in enumerate(tree_chain_star_deep(vocab)):
        depth = max(depths_from_parents(torch.tensor(par)).tolist())
        cases.append((tok, par, Table(vocab, seed=10 + k, den=8 if depth >= 3 else 16)))
    dists = grid_distributions(lambda p, t, u: verify_target_only(p, t, uniforms=u), cases)
    for (tok, par, table), dist in zip(cases, dists):
        assert_lossless(dist, table, tok[0], max(depths_from_parents(torch.tensor(par)).tolist()) + 1)


def test_target_only_duplicate_child_is_never_accepted():
    tok, par = [1, 2, 0, 2, 1, 3, 0, 2], [-1, 0, 0, 0, 1, 1, 4, 3]
    table = Table(4, seed=3, den=8)
    rows = node_rows(tok, par, table)
    mids = (torch.arange(8, dtype=F64) + 0.5) / 8
    grid = torch.cartesian_prod(mids, mids, mids, mids)
    trees = make_batch([(tok, par, None)] * grid.shape[0])
    res = verify_target_only(rows.repeat(grid.shape[0], 1), trees, uniforms=grid)
    assert not bool((res.accepted_nodes == 3).any()) and not bool((res.accepted_nodes == 7).any())
    assert bool((res.accepted_nodes[:, 0] == 1).any())  # the first token-2 child is accepted sometimes


def test_target_only_ragged_batch_matches_single_requests():
    vocab = 4
    shapes = tree_chain_star_deep(vocab)
    trees = make_batch([(t, p, None) for t, p in shapes])
    table = Table(vocab, seed=5)
    probs = torch.cat([node_rows(t, p, table) for t, p in shapes])
    u = torch.rand(len(shapes), 4, generator=torch.Generator().manual_seed(0), dtype=F64)
    res = verify_target_only(probs, trees, uniforms=u)
    for r, (t, p) in enumerate(shapes):
        d = max(depths_from_parents(torch.tensor(p)).tolist())
        one = verify_target_only(node_rows(t, p, table), make_batch([(t, p, None)]), uniforms=u[r : r + 1, : d + 1])
        assert emitted_of(res, r) == emitted_of(one, 0) and int(res.last_node[r]) == int(one.last_node[0])


def wrong_target_only(probs: torch.Tensor, trees: TreeBatch, uniforms: torch.Tensor, variant: str) -> AcceptResult:
    """Target-only as a per-request loop: variant "none" is correct, the others deliberately wrong.

    "keep_children": on failure the bonus comes from the full target, children not removed.
    "count_duplicates": a duplicated child token gets its probability once per occurrence.
    """
    tok, par, cu = trees.tokens.tolist(), trees.parents.tolist(), trees.cu_nodes.tolist()
    last, bonus = [], []
    for r in range(trees.num_requests):
        s, e = cu[r], cu[r + 1]
        v, d = 0, 0
        while True:
            p = probs[s + v].tolist()
            u = float(uniforms[r, d])
            ch = [c for c in range(1, e - s) if par[s + c] == v]
            seen, acc, nxt = set(), 0.0, None
            for c in ch:
                if tok[s + c] in seen and variant != "count_duplicates":
                    continue
                seen.add(tok[s + c])
                acc += p[tok[s + c]]
                if u < acc:
                    nxt = c
                    break
            if nxt is None:
                rest = p if variant == "keep_children" else [0.0 if x in seen else px for x, px in enumerate(p)]
                x_u = (u - acc) / max(1 - acc, 1e-300) * sum(rest)
                cum, b = 0.0, max(x for x, w in enumerate(rest) if w > 0)
                for x, w in enumerate(rest):
                    cum += w
                    if x_u < cum:
                        b = x
                        break
                last.append(s + v)
                bonus.append(b)
                break
            v, d = nxt, d + 1
    return accept_result_from_last_node(trees, torch.tensor(last), torch.tensor(bonus))


def test_distribution_check_catches_wrong_target_only_samplers():
    # A star with token 2 twice under the root. With p in multiples of 1/8 every threshold of these
    # loop samplers (children mass a/8, then a/8 + (1 - a/8) b/8) is a multiple of 1/64: exact grid.
    vocab = 4
    tok, par = [1, 2, 0, 2], [-1, 0, 0, 0]
    table = Table(vocab, seed=29, den=8)
    assert bool((table((1,))[[0, 2]] > 0).all())  # both root child tokens carry target mass
    case = [(tok, par, table)]
    right = grid_distributions(lambda p, t, u: wrong_target_only(p, t, u, "none"), case, den=64)[0]
    assert_lossless(right, table, 1, 2)  # the loop sampler without a bug is exact
    for variant in ("keep_children", "count_duplicates"):
        dist = grid_distributions(lambda p, t, u: wrong_target_only(p, t, u, variant), case, den=64)[0]
        with pytest.raises(AssertionError):
            assert_lossless(dist, table, 1, 2)


# ----------------------------------------------------------------------------------------------
# traversal


def wor_trees(draft: Table, root: int, branching: list[int]) -> list[tuple[list[int], list[int], float]]:
    """Every tree sample_tree_from_draft can draw (breadth-first, children without replacement)
    with its probability prod q(c_i) / (1 - sum_{j<i} q(c_j))."""
    out = []

    def expand(tokens: list[int], parents: list[int], v: int, prob: float) -> None:
        if v == len(tokens):
            out.append((tokens, parents, prob))
            return
        depth = len(path_tokens(tokens, parents, v)) - 1
        if depth >= len(branching):
            expand(tokens, parents, v + 1, prob)
            return
        q = draft(path_tokens(tokens, parents, v)).tolist()
        support = [x for x in range(len(q)) if q[x] > 0]
        k = min(branching[depth], len(support))
        for seq in itertools.permutations(support, k):
            pr, used = prob, 0.0
            for x in seq:
                pr *= q[x] / (1 - used)
                used += q[x]
            expand(tokens + list(seq), parents + [v] * k, v + 1, pr)

    expand([root], [-1], 0, 1.0)
    return out


def drafter_cases(group: object, target: Table, draft: Table, root: int, branching: list[int]) -> list:
    """Every tree drawn from ``draft`` (with its probability) as traversal cases of one group."""
    cases = []
    for tok, par, prob in wor_trees(draft, root, branching):
        depth = depths_from_parents(torch.tensor(par)).tolist()
        zeros = torch.zeros(target.vocab, dtype=F64)
        q_rows = torch.stack(
            [draft(path_tokens(tok, par, i)) if depth[i] < len(branching) else zeros for i in range(len(tok))]
        )
        cases.append((group, tok, par, node_rows(tok, par, target), q_rows, None, prob))
    return cases


DRAFTER_FAMILIES = [(3, [1, 1, 1]), (3, [3]), (3, [2, 1]), (4, [2, 1]), (3, [2, 2]), (4, [1, 2])]


@pytest.mark.parametrize("vocab", [3, 4])
def test_traversal_exact_over_trees_drawn_from_the_drafter(vocab):
    # all families of one vocabulary (chains, stars, bushy trees; different sizes) in one ragged batch
    cases, tables = [], {}
    for k, (v, branching) in enumerate(DRAFTER_FAMILIES):
        if v != vocab:
            continue
        tables[k] = Table(vocab, seed=100 + k)
        draft = Table(vocab, seed=200 + k, zero=k % 2 == 0)  # some drafts have full support
        fam = drafter_cases(k, tables[k], draft, root=1, branching=branching)
        assert abs(sum(c[6] for c in fam) - 1) < 1e-12
        cases += fam
    dists = traversal_distributions(cases)
    for k, (v, branching) in enumerate(DRAFTER_FAMILIES):
        if v == vocab:
            assert_lossless(dists[k], tables[k], 1, len(branching) + 1)


def test_traversal_sibling_mode_exact_for_fixed_trees():
    vocab = 4
    gen = torch.Generator().manual_seed(7)
    shapes = tree_chain_star_deep(vocab)[:2] + [
        ([1, 2, 0, 3, 1, 3, 0, 2], [-1, 0, 0, 0, 1, 1, 4, 3]),
        ([0, 1, 2, 3, 0, 2, 3, 1], [-1, 0, 0, 0, 1, 1, 5, 2]),
    ]
    cases, tables = [], []
    for k, (tok, par) in enumerate(shapes):
        tables.append(Table(vocab, seed=300 + k))
        logq = (torch.randn(len(tok), generator=gen, dtype=F64) * 1.5).tolist()
        logq[0] = 0.0
        cases.append((k, tok, par, node_rows(tok, par, tables[k]), None, logq, 1.0))
    dists = traversal_distributions(cases)
    for k, (tok, par) in enumerate(shapes):
        assert_lossless(dists[k], tables[k], tok[0], max(depths_from_parents(torch.tensor(par)).tolist()) + 1)


def test_traversal_draft_equal_to_target_accepts_first_leaf():
    # q == p: every acceptance probability is 1, so the first leaf in visiting order is accepted
    table = Table(3, seed=9, zero=False)
    tok, par = [0, 1, 2, 2], [-1, 0, 0, 1]
    rows = node_rows(tok, par, table)
    for u in (0.0, 0.5, 0.999):
        uniforms = torch.full((1, 9), u, dtype=F64)
        res = verify_traversal(rows, make_batch([(tok, par, None)]), draft_probs=rows, uniforms=uniforms)
        assert res.last_node.tolist() == [3]


@pytest.mark.parametrize("bug", ["keep_target", "keep_alpha", "keep_draft"])
def test_distribution_check_catches_wrong_traversal(bug):
    target, draft = Table(4, seed=102), Table(4, seed=202, zero=False)
    cases = drafter_cases(0, target, draft, root=1, branching=[2, 1])
    assert_lossless(traversal_distributions(cases, run_verifier=False)[0], target, 1, 3)  # the reference is exact
    with pytest.raises(AssertionError):
        assert_lossless(traversal_distributions(cases, bug=bug, run_verifier=False)[0], target, 1, 3)


def test_traversal_fixed_tree_in_drafter_mode_is_not_lossless():
    # the drafter-mode guarantee is over the random tree: one fixed tree verified as if drawn from q
    # is biased, so the check must fail on it
    target, draft = Table(3, seed=103), Table(3, seed=203)
    case = drafter_cases(0, target, draft, root=1, branching=[2, 1])[0]
    with pytest.raises(AssertionError):
        assert_lossless(traversal_distributions([case[:6] + (1.0,)])[0], target, 1, 3)


def test_sample_tree_from_draft_draws_without_replacement():
    vocab, branching = 3, [2, 1]
    draft = Table(vocab, seed=50, zero=False)
    expected = {(tuple(t), tuple(p)): w for t, p, w in wor_trees(draft, 2, branching)}

    def reference(src: Source) -> tuple[tuple[int, ...], tuple[int, ...]]:
        tokens, parents, v, col = [2], [-1], 0, 0
        while v < len(tokens):
            if len(path_tokens(tokens, parents, v)) - 1 < len(branching):
                q = draft(path_tokens(tokens, parents, v)).tolist()
                for _ in range(min(branching[len(path_tokens(tokens, parents, v)) - 1], sum(x > 0 for x in q))):
                    x = src.draw(col, q)
                    col += 1
                    q[x] = 0.0
                    tokens.append(x)
                    parents.append(v)
            v += 1
        return tuple(tokens), tuple(parents)

    got: dict = defaultdict(float)
    for draws, out in enumerate_paths(reference):
        for j, row in enumerate(probe_rows(draws, 6)):
            tree, dprobs = sample_tree_from_draft(draft, 2, branching, uniforms=row)
            key = (tuple(tree.tokens.tolist()), tuple(tree.parents.tolist()))
            assert key == out
            if j == 0:
                got[key] += math.prod(hi - lo for _, lo, hi in draws)
                for i in range(1, tree.num_nodes):
                    q_par = draft(path_tokens(list(key[0]), list(key[1]), key[1][i]))
                    assert math.isclose(float(tree.draft_logprobs[i]), math.log(float(q_par[key[0][i]])))
                    torch.testing.assert_close(dprobs[key[1][i]], q_par)
                    if tree.depth[i] == len(branching):
                        assert not bool(dprobs[i].any())  # the deepest nodes are never expanded
    assert set(got) == set(expected)
    assert max(abs(got[k] - expected[k]) for k in expected) < 1e-12


# ----------------------------------------------------------------------------------------------
# dispatcher


def test_verify_tree_mixed_greedy_and_sampling_batch():
    vocab = 5
    gen = torch.Generator().manual_seed(3)
    shapes = [
        ([0, 1, 2, 3, 4], [-1, 0, 0, 1, 3]),
        ([2, 3], [-1, 0]),
        ([1, 0, 2, 4], [-1, 0, 1, 0]),
        ([4, 3, 1], [-1, 0, 0]),
    ]
    dl = [[0.0] + torch.randn(len(t) - 1, generator=gen).tolist() for t, _ in shapes]
    trees = make_batch([(t, p, d) for (t, p), d in zip(shapes, dl)])
    logits = torch.randn(trees.num_nodes, vocab, generator=gen, dtype=F64) * 2
    params = TreeSamplingParams.from_lists(
        [0.0, 0.8, 1e-6, 1.2], top_k=[0, 3, 2, 0], top_p=[1.0, 1.0, 1.0, 0.7], min_p=[0.0, 0.0, 0.0, 0.1]
    )
    greedy = verify_greedy(logits, trees)
    probs = process_logits(logits, params, trees.cu_nodes)
    for method, direct in (("target_only", verify_target_only), ("traversal", verify_traversal)):
        u = torch.rand(4, uniform_width(trees, method), generator=gen, dtype=F64)
        res = verify_tree(logits, trees, params, method=method, uniforms=u)
        check_contract(res, trees)
        sampled = direct(probs, trees, uniforms=u)
        for r in range(4):
            want = greedy if r in (0, 2) else sampled
            assert emitted_of(res, r) == emitted_of(want, r) and int(res.last_node[r]) == int(want.last_node[r])
    all_greedy = TreeSamplingParams.from_lists([0.0] * 4)
    res = verify_tree(logits, trees, all_greedy, method="traversal")
    assert torch.equal(res.output_tokens, greedy.output_tokens)


def test_verify_tree_exact_through_temperature_and_min_p():
    # logits = T * log p for a dyadic p, plus tokens at -60 that min-p removes: the processed
    # target is exactly the dyadic table, so the grid integration applies end to end.
    vocab, temperature = 4, 0.5
    table = Table(vocab, seed=77, den=16)
    tok, par = [1, 2, 0, 3, 1], [-1, 0, 0, 1, 2]
    rows = node_rows(tok, par, table)
    logits = torch.where(rows > 0, rows.log(), torch.full_like(rows, -60.0)) * temperature

    def through_dispatcher(p: torch.Tensor, trees: TreeBatch, u: torch.Tensor) -> AcceptResult:
        num = trees.num_requests
        params = TreeSamplingParams.from_lists([temperature] * num, min_p=[0.01] * num)
        return verify_tree(logits.repeat(num, 1), trees, params, uniforms=u)

    dist = grid_distributions(through_dispatcher, [(tok, par, table)])[0]
    assert_lossless(dist, table, 1, 3)


def test_errors_name_the_problem():
    trees = make_batch([([0, 1, 1], [-1, 0, 0], [0.0, -1.0, -2.0])])
    probs = torch.full((3, 3), 1 / 3, dtype=F64)
    with pytest.raises(ValueError, match=r"probs must be \[T=3, V\]"):
        verify_target_only(probs[:2], trees)
    with pytest.raises(ValueError, match=r"needs uniforms of shape \[1, 2\]"):
        verify_target_only(probs, trees, uniforms=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"uniforms must lie in \[0, 1\)"):
        verify_target_only(probs, trees, uniforms=torch.ones(1, 2))
    with pytest.raises(ValueError, match="distinct sibling tokens: nodes 1 and 2"):
        verify_traversal(probs, trees)
    no_dl = make_batch([([0, 1, 2], [-1, 0, 0], None)])
    with pytest.raises(ValueError, match="needs draft_probs or trees.draft_logprobs"):
        verify_traversal(probs, no_dl)
    q = torch.tensor([[0.5, 0.5, 0.0]] * 3, dtype=F64)
    with pytest.raises(ValueError, match="token 2 with draft probability 0"):
        verify_traversal(probs, no_dl, draft_probs=q)
    with pytest.raises(ValueError, match="unknown verification method 'beam'"):
        verify_tree(probs, no_dl, TreeSamplingParams.from_lists([1.0]), method="beam")
    with pytest.raises(ValueError, match="params hold 2 requests, the tree batch 1"):
        verify_tree(probs, no_dl, TreeSamplingParams.from_lists([1.0, 1.0]))
    assert uniform_width(no_dl, "greedy") == 0 and uniform_width(no_dl, "target_only") == 2
    assert uniform_width(no_dl, "traversal") == 7


def test_generators_make_draws_reproducible():
    trees = make_batch([([0, 1, 2], [-1, 0, 1], None), ([1, 2], [-1, 0], None)])
    probs = torch.softmax(torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=F64), dim=-1)
    a = verify_target_only(probs, trees, generator=torch.Generator().manual_seed(5))
    b = verify_target_only(probs, trees, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.output_tokens, b.output_tokens)
    seeded = {1: torch.Generator().manual_seed(9)}
    c = verify_target_only(probs, trees, generator=seeded)
    d = verify_target_only(probs, trees, generator={1: torch.Generator().manual_seed(9)})
    assert torch.equal(c.output_tokens[1], d.output_tokens[1])

"""Tree / TreeBatch (vllm_tfm.tree.types): validation, ancestor relation, bitmask packing, batching."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_tfm.tree import Tree, TreeBatch, ancestor_mask, depths_from_parents, pack_bitmask


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def path_by_walking(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def expected_words(parents: list[int]) -> list[list[int]]:
    """Row i of the ancestor-or-self relation packed with Python ints, as signed 64-bit words."""
    n = len(parents)
    nw = (n + 63) // 64
    rows = []
    for i in range(n):
        words = [0] * nw
        for j in path_by_walking(parents, i):
            words[j // 64] |= 1 << (j % 64)
        rows.append([w - (1 << 64) if w >= (1 << 63) else w for w in words])
    return rows


@pytest.mark.parametrize(
    "tokens, parents, match",
    [
        ([], [], "non-empty 1-D"),
        ([[1, 2]], [[-1, 0]], "non-empty 1-D"),
        ([5, 6], [0, 0], "node 0 must be the root"),
        ([5, 6, 7], [-1, 1, 0], "node 1 has parent 1"),
        ([5, 6, 7], [-1, 0, 3], "node 2 has parent 3"),
        ([5, 6, 7], [-1, -1, 0], "node 1 has parent -1"),
        ([5, 6], [-1, 0, 1], r"tokens \(2,\) and parents \(3,\) differ"),
    ],
)
def test_from_parents_rejects_invalid(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_parents(tokens, parents)


def test_from_parents_rejects_mismatched_scores_and_logprobs():
    with pytest.raises(ValueError, match=r"scores has shape \(2,\), expected \(3,\)"):
        Tree.from_parents([1, 2, 3], [-1, 0, 0], scores=torch.zeros(2))
    with pytest.raises(ValueError, match=r"draft_logprobs has shape \(3, 1\), expected \(3,\)"):
        Tree.from_parents([1, 2, 3], [-1, 0, 0], draft_logprobs=torch.zeros(3, 1))


def test_depth_children_and_path_of_a_fixed_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    t = Tree.from_parents([10, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3])
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.max_depth == 3
    assert t.num_nodes == 7
    assert t.path(6) == [0, 1, 3, 6]
    assert t.path(0) == [0]
    assert t.children(0) == [1, 2]
    assert t.children(1) == [3, 4]
    assert t.children(6) == []
    m = t.ancestor_mask()
    assert m[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_mask_matches_paths_on_random_trees(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    parents = random_parents(n, rng)
    t = Tree.from_parents(list(range(n)), parents)
    m = t.ancestor_mask()
    assert m.dtype == torch.bool and m.shape == (n, n)
    for i in range(n):
        assert set(m[i].nonzero().flatten().tolist()) == path_by_walking(parents, i)
        assert set(t.path(i)) == path_by_walking(parents, i)
        assert t.depth[i].item() == len(path_by_walking(parents, i)) - 1
    assert torch.equal(ancestor_mask(torch.tensor(parents)), m)
    assert torch.equal(depths_from_parents(torch.tensor(parents)), t.depth)


def test_chain_tree():
    t = Tree.chain([7, 8, 9, 10])
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert t.depth.tolist() == [0, 1, 2, 3]
    assert torch.equal(t.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("n", [1, 63, 64, 65, 130])
def test_bitmask_packing(n):
    rng = random.Random(n)
    for parents in (random_parents(n, rng), list(range(-1, n - 1))):  # random tree, then the chain
        t = Tree.from_parents(list(range(n)), parents)
        bm = t.ancestor_bitmask()
        assert bm.dtype == torch.int64
        assert bm.shape == (n, (n + 63) // 64)
        assert bm.tolist() == expected_words(parents)
    if n >= 64:
        # the chain's row 63 sets bit 63 of word 0: the sign bit of a two's-complement int64
        assert int(bm[63, 0]) == -1
        assert int(bm[62, 0]) == (1 << 63) - 1


def test_pack_bitmask_arbitrary_mask():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 70, generator=g) < 0.5
    packed = pack_bitmask(mask)
    assert packed.shape == (5, 2)
    for i in range(5):
        for j in range(70):
            assert bool((int(packed[i, j // 64]) >> (j % 64)) & 1) == bool(mask[i, j])


def _sample_trees() -> list[Tree]:
    a = Tree.from_parents([1, 2, 3], [-1, 0, 0], torch.tensor([0.0, -0.5, -1.0]), torch.tensor([0.0, -0.5, -1.0]))
    b = Tree.from_parents([4], [-1], torch.tensor([0.0]), torch.tensor([0.0]))
    c = Tree.from_parents([5, 6, 7, 8], [-1, 0, 1, 1], torch.tensor([0.0, -1.0, -3.0, -4.0]),
                          torch.tensor([0.0, -1.0, -2.0, -3.0]))
    return [a, b, c]


def test_tree_batch_roundtrip_and_global_parents():
    trees = _sample_trees()
    batch = TreeBatch.from_trees(trees)
    assert batch.num_requests == 3
    assert batch.num_nodes == 8
    assert batch.cu_nodes.tolist() == [0, 3, 4, 8]
    assert batch.cu_nodes.dtype == torch.int64
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.parents.tolist() == [-1, 0, 0, -1, -1, 0, 1, 1]
    assert batch.depth.tolist() == [0, 1, 1, 0, 0, 1, 2, 2]
    assert batch.global_parents().tolist() == [-1, 0, 0, -1, -1, 4, 5, 5]
    assert batch.request_index().tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert batch.draft_logprobs.tolist() == [0.0, -0.5, -1.0, 0.0, 0.0, -1.0, -2.0, -3.0]
    assert batch.scores.tolist() == [0.0, -0.5, -1.0, 0.0, 0.0, -1.0, -3.0, -4.0]
    back = batch.trees()
    assert len(back) == 3
    for orig, got in zip(trees, back):
        for field in ("tokens", "parents", "depth", "scores", "draft_logprobs"):
            assert torch.equal(getattr(orig, field), getattr(got, field)), field
    moved = batch.to("cpu")
    assert torch.equal(moved.scores, batch.scores) and torch.equal(moved.cu_nodes, batch.cu_nodes)


def test_tree_batch_drops_optional_fields_unless_every_tree_has_them():
    trees = _sample_trees() + [Tree.chain([9, 10])]
    batch = TreeBatch.from_trees(trees)
    assert batch.draft_logprobs is None and batch.scores is None
    assert batch.tree(3).tokens.tolist() == [9, 10]
    assert batch.tree(3).draft_logprobs is None


def test_tree_batch_needs_a_tree():
    with pytest.raises(ValueError, match="at least one tree"):
        TreeBatch.from_trees([])

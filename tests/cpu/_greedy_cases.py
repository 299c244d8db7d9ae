"""Greedy tree acceptance cases shared by the CPU emulation test and the GPU test of
``cuda/tree_greedy_accept.cu``: random batches with walks of chosen depth, and the walk written with Python loops."""

from __future__ import annotations

import numpy as np
import torch
from _trees import random_tree_parents

from vllm_tfm.tree.bitmask import ragged_depths

VOCAB = 7  # small: sibling tokens repeat


def greedy_batch(sizes_kinds: list[tuple[int, str]], seed: int, follow: float, drafts_dtype: torch.dtype):
    """(target, parents, cu, drafts, dmax, max_nodes): random draft tokens; at each node the target's argmax
    is one of its children's tokens with probability ``follow`` (else a random token)."""
    g = torch.Generator().manual_seed(seed)
    trees = [random_tree_parents(n, g, kind) for n, kind in sizes_kinds]
    parents = torch.cat(trees)
    cu = torch.zeros(len(trees) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor([t.numel() for t in trees]).cumsum(0)
    t = int(cu[-1])
    tokens = torch.randint(0, VOCAB, (t,), generator=g)
    target = torch.randint(0, VOCAB, (t,), generator=g)
    for r, tree in enumerate(trees):
        base = int(cu[r])
        for i in range(tree.numel()):
            kids = [j for j in range(i + 1, tree.numel()) if int(tree[j]) == i]
            if kids and float(torch.rand((), generator=g)) < follow:
                target[base + i] = tokens[base + kids[int(torch.randint(0, len(kids), (1,), generator=g))]]
    nonroot = parents >= 0
    drafts = tokens[nonroot].to(drafts_dtype).contiguous()
    dmax = int(ragged_depths(parents.numpy(), cu.numpy()).max())
    return target, parents, cu, drafts, dmax, max(tr.numel() for tr in trees), tokens


def brute_greedy_walk(parents: list[int], tokens: list[int], argmax: list[int]) -> tuple[list[int], int]:
    """One tree by brute force: from the root, follow the first child carrying the target argmax.
    Returns (the accepted local nodes root-first, the bonus token)."""
    node, path = 0, []
    while True:
        nxt = [j for j in range(1, len(parents)) if parents[j] == node and tokens[j] == argmax[node]]
        if not nxt:
            return path, argmax[node]
        node = nxt[0]
        path.append(node)


def greedy_loops(target, parents, cu, tokens, dmax: int, cols: int):
    """``brute_greedy_walk`` per request of a ragged batch, in the kernel's output layout."""
    r = cu.shape[0] - 1
    acc = np.full((r, dmax), -1)
    out = np.full((r, cols), -1)
    num, last, bonus = np.zeros(r, dtype=np.int64), np.zeros(r, dtype=np.int64), np.zeros(r, dtype=np.int64)
    for k in range(r):
        lo, hi = int(cu[k]), int(cu[k + 1])
        path, b = brute_greedy_walk(parents[lo:hi].tolist(), tokens[lo:hi].tolist(), target[lo:hi].tolist())
        acc[k, : len(path)] = path
        out[k, : len(path)] = [int(tokens[lo + i]) for i in path]
        out[k, len(path)] = b
        num[k], last[k], bonus[k] = len(path), path[-1] if path else 0, b
    return acc, num, last, bonus, out


def planted_step(r: int, n: int, vocab: int, seed: int):
    """(logits float32 [r n, vocab], parents [r n], tokens [r n]) of r trees of n nodes (random and deep
    alternately), random tokens, with a path of random length planted in each tree: the argmax at each of its
    nodes' parents is that node's token. The 27B tree step's shape at vocab 248320 and n = 17."""
    g = torch.Generator().manual_seed(seed)
    trees = [random_tree_parents(n, g, "deep" if k % 2 else "random") for k in range(r)]
    tokens = torch.randint(0, vocab, (r * n,), generator=g)
    logits = torch.randn(r * n, vocab, generator=g)
    for k, tree in enumerate(trees):
        node = int(torch.randint(0, n, (1,), generator=g))
        while node > 0:
            logits[k * n + int(tree[node]), tokens[k * n + node]] = 30.0
            node = int(tree[node])
    return logits, torch.cat(trees), tokens


GREEDY_CASES = [
    ([(17, "random")], 0.9),
    ([(17, "chain")], 1.0),  # the walk reaches the leaf
    ([(17, "chain")], 0.0),  # ends at the root (almost surely)
    ([(1, "chain")], 0.9),  # a request without drafts
    ([(33, "star")], 0.9),
    ([(65, "deep")], 0.95),
    ([(17, "random"), (1, "chain"), (9, "deep"), (17, "star"), (5, "chain")], 0.8),
    ([(129, "deep"), (40, "random"), (2, "chain")], 0.9),
    ([(300, "random"), (17, "random")], 0.9),  # more nodes than a CTA's threads
]


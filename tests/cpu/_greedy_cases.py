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


def greedy_loops(target, parents, cu, tokens, dmax: int, cols: int):
    """The greedy walk with Python loops: per request, the first child (index order) carrying the argmax."""
    r = cu.shape[0] - 1
    acc = np.full((r, dmax), -1)
    out = np.full((r, cols), -1)
    num, last, bonus = np.zeros(r, dtype=np.int64), np.zeros(r, dtype=np.int64), np.zeros(r, dtype=np.int64)
    for k in range(r):
        base, n = int(cu[k]), int(cu[k + 1] - cu[k])
        cur, path = 0, []
        while True:
            nxt = [i for i in range(cur + 1, n) if int(parents[base + i]) == cur and int(tokens[base + i]) == int(target[base + cur])]
            if not nxt:
                break
            cur = nxt[0]
            path.append(cur)
        acc[k, : len(path)] = path
        out[k, : len(path)] = [int(tokens[base + i]) for i in path]
        out[k, len(path)] = int(target[base + cur])
        num[k], last[k], bonus[k] = len(path), cur, int(target[base + cur])
    return acc, num, last, bonus, out


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


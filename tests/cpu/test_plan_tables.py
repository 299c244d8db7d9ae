"""``TreePlan`` tables against a per-node Python walk: level order, root-to-node paths, depths, inverse order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_tfm.kernels.plan import TreePlan


def walk(par: list[int], cu: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(level order, pair offsets, pairs, depths) by following each node's parents up to the root."""
    perm, offs, pairs, depth = [], [0], [], [0] * len(par)
    for r in range(len(cu) - 1):
        b, e = cu[r], cu[r + 1]
        for i in range(b, e):
            depth[i] = 0 if par[i] < 0 else depth[b + par[i]] + 1
        for i in sorted(range(b, e), key=lambda i: (depth[i], i)):
            path, j = [], i
            while True:
                path.append(j)
                if par[j] < 0:
                    break
                j = b + par[j]
            pairs += path[::-1]
            offs.append(offs[-1] + len(path))
            perm.append(i)
    return perm, offs, pairs, depth


@pytest.mark.parametrize("seed", range(6))
def test_plan_tables_follow_each_node_path(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):
        sizes = rng.integers(1, 70, int(rng.integers(1, 7)))
        par: list[int] = []
        for n in sizes:
            kind = int(rng.integers(0, 3))  # chain, star, random
            par += [-1] + [i - 1 if kind == 0 else 0 if kind == 1 else int(rng.integers(0, i)) for i in range(1, int(n))]
        cu = [0, *np.cumsum(sizes).tolist()]
        plan = TreePlan.build(torch.tensor(par), torch.tensor(cu))
        perm, offs, pairs, depth = walk(par, cu)
        assert plan.perm.tolist() == perm and plan.pair_off.tolist() == offs and plan.pair_j.tolist() == pairs
        assert plan.depth.tolist() == depth and plan.max_depth == max(depth)
        assert plan.pos[plan.perm.long()].tolist() == list(range(len(par)))
        assert plan.req_of.tolist() == np.repeat(np.arange(len(sizes)), sizes).tolist()
        assert plan.max_pairs_per_request == max(offs[cu[r + 1]] - offs[cu[r]] for r in range(len(sizes)))

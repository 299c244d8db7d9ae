#!/usr/bin/env python3
"""Shared-memory wavefronts of version 8's path-row reads of X, counted on the CPU (bench/NOTES.md section 78).

``p8_path_rows`` (cuda/gdn_tree_verify_paths.cu) gives each (value head, node) thread its node's rows of T and W by
back substitution along the path: for each path entry w = 1 .. d - 1 and term u = 0 .. w - 1 it reads
X[pbp[last - u] + d - 1 - w] (value head gv's products at word offset gv A). A warp issues one read for each (w, u)
any of its lanes has; the read costs as many shared-memory wavefronts as the most distinct words that fall in one of
the 32 four-byte banks (one word read by several lanes is a broadcast). This counts reads and wavefronts for a CTA's
threads taken by local node (section 77's kernel) or by level position (perm), on bench/gdn_tree.py's trees.

usage (repository root, no GPU):  python3 bench/path_row_reads.py --n 128 [--groups 3]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from vllm_tfm.kernels.plan import TreePlan  # noqa: E402


def node_reads(pb: list[int], plen: list[int], pbp: list[int], i: int, base: int) -> dict[tuple[int, int], int]:
    """Node i's X reads, (w, u) -> word offset, for products at ``base``."""
    d, last = plen[i], pb[i] + plen[i] - 1
    return {(w, u): base + pbp[last - u] + d - 1 - w for w in range(1, d) for u in range(w)}


def count(plan: TreePlan, request: int, groups: int, level_order: bool) -> dict[str, int]:
    """Warp reads, wavefronts and lane reads of one request's path rows (threads: value head major, then nodes)."""
    cu = plan.cu.tolist()
    bos, n = cu[request], cu[request + 1] - cu[request]
    perm, off, pj = plan.perm.tolist(), plan.pair_off.tolist(), plan.pair_j.tolist()
    pbase = off[bos]
    pb, plen = [0] * n, [0] * n
    for p in range(n):
        i = perm[bos + p] - bos
        pb[i], plen[i] = off[bos + p] - pbase, off[bos + p + 1] - off[bos + p]
    cnt = off[bos + n] - pbase
    pbp = [pb[pj[pbase + e] - bos] for e in range(cnt)]
    a = (cnt + 3) & ~3
    nodes = [perm[bos + p] - bos for p in range(n)] if level_order else list(range(n))
    items = [(gv, i) for gv in range(groups) for i in nodes]
    out = Counter()
    for w0 in range(0, len(items), 32):
        lanes = [node_reads(pb, plen, pbp, i, gv * a) for gv, i in items[w0 : w0 + 32]]
        for slot in set().union(*lanes):
            words = {r[slot] for r in lanes if slot in r}
            out["warp_reads"] += 1
            out["wavefronts"] += max(Counter(x % 32 for x in words).values())
            out["lane_reads"] += sum(slot in r for r in lanes)
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    from gdn_tree import tree_batch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=128, help="nodes of bench/gdn_tree.py's tree")
    ap.add_argument("--groups", type=int, default=3, help="value heads a q/k head (a CTA's threads: groups n)")
    args = ap.parse_args(argv)
    parents, cu, _ = tree_batch(args.n, 1)
    plan = TreePlan.build(parents, cu, device="cpu")
    print(f"n = {args.n}: depth {plan.max_depth}, {plan.num_pairs} path entries, {args.groups} value heads")
    for name, level in (("local node order", False), ("level order", True)):
        c = count(plan, 0, args.groups, level)
        print(f"{name:>16}: {c['warp_reads']} warp reads, {c['wavefronts']} wavefronts, {c['lane_reads']} lane reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())

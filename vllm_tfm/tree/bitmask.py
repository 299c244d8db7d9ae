"""Ancestor bitmasks and depths of a ragged tree batch, vectorised (numpy, no per-request or per-node loop).

Row i of the result packs node i's ancestor-or-self set within its own tree: bit ``j % 64`` of
word ``j // 64`` for every local node j on the root..i path (the layout of
``vllm_tfm.tree.types.pack_bitmask``, batched). Built by pointer doubling: after round k a node's
row holds its ancestors closer than 2^k and its jump pointer names the ancestor 2^k up, so
ceil(log2(max depth + 1)) rounds of whole-array operations cover every path. Depths come from the
same pointer doubling, summing the jumped distances (``ragged_depths``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ragged_ancestor_bits", "ragged_depths"]


def ragged_ancestor_bits(parents: np.ndarray, cu_nodes: np.ndarray, words: int | None = None) -> np.ndarray:
    """[T, words] int64 ancestor-or-self bitmasks of the trees in a ragged batch.

    parents: [T] local parents (-1 at each root, else 0 <= parent < local index);
    cu_nodes: [R + 1] prefix sums of the node counts (every tree non-empty);
    words: words per row (default ceil(largest tree / 64); must cover the largest tree).
    Raises ValueError naming the first malformed entry.
    """
    par = np.asarray(parents, dtype=np.int64)
    cu = np.asarray(cu_nodes, dtype=np.int64)
    if par.ndim != 1 or cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"parents must be [T] and cu_nodes [R + 1], got shapes {par.shape} and {cu.shape}")
    total = par.shape[0]
    sizes = np.diff(cu)
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_nodes must start at 0 and end at the number of nodes {total}, got {int(cu[0])}..{int(cu[-1])}")
    if (sizes <= 0).any():
        r = int(np.nonzero(sizes <= 0)[0][0])
        raise ValueError(f"tree {r} has {int(sizes[r])} nodes; every tree needs at least its root")
    need = int((int(sizes.max()) + 63) // 64) if sizes.size else 1
    words = need if words is None else int(words)
    if words < need:
        raise ValueError(f"{words} words per row cannot hold a tree of {int(sizes.max())} nodes")
    bits = np.zeros((total, words), dtype=np.uint64)
    if total == 0:
        return bits.view(np.int64)
    starts = np.repeat(cu[:-1], sizes)
    local = np.arange(total, dtype=np.int64) - starts
    is_root = local == 0
    bad = (is_root & (par != -1)) | (~is_root & ((par < 0) | (par >= local)))
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise ValueError(
            f"parents[{i}] = {int(par[i])} is invalid for local node {int(local[i])}: "
            "the root needs -1 and every other node 0 <= parent < its local index"
        )
    rows = np.arange(total)
    bits[rows, local // 64] = np.left_shift(np.uint64(1), (local % 64).astype(np.uint64))
    jump = np.where(is_root, -1, par + starts)  # flat index of the ancestor 2^k up (-1: past the root)
    live = np.nonzero(jump >= 0)[0]
    while live.size:
        up = jump[live]
        bits[live] |= bits[up]  # right-hand sides are read (copied) before any row is written
        jump[live] = jump[up]
        live = live[jump[live] >= 0]
    return bits.view(np.int64)


def ragged_depths(parents: np.ndarray, cu_nodes: np.ndarray) -> np.ndarray:
    """[T] int64 depth of every node (root 0) of a ragged batch of trees in topological order.

    parents: [T] local parents (-1 at each root); cu_nodes: [R + 1] prefix sums of the node
    counts. Pointer doubling: ``depth`` holds the distance to the node ``jump`` points at, and each
    round adds the distance of that node and jumps twice as far.
    """
    par = np.asarray(parents, dtype=np.int64)
    cu = np.asarray(cu_nodes, dtype=np.int64)
    starts = np.repeat(cu[:-1], np.diff(cu))
    jump = np.where(par < 0, -1, par + starts)
    depth = (jump >= 0).astype(np.int64)
    live = np.nonzero(jump >= 0)[0]
    rounds = 0
    while live.size:
        rounds += 1
        if rounds > 64:
            raise ValueError("parents do not form trees (a parent chain does not reach a root)")
        up = jump[live]
        depth[live] += depth[up]  # right-hand sides are read before any entry is written
        jump[live] = jump[up]
        live = live[jump[live] >= 0]
    return depth

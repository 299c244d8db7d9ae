"""Ancestor bitmasks and depths of a ragged tree batch, vectorised (numpy, no per-request or per-node loop).

Row i of the result packs node i's ancestor-or-self set within its own tree: bit ``j % 64`` of
word ``j // 64`` for every local node j on the root..i path (the layout of
``vllm_tfm.tree.types.pack_bitmask``, batched). Built by pointer doubling: after round k a node's
row holds its ancestors closer than 2^k and its jump pointer names the ancestor 2^k up, so
ceil(log2(max depth + 1)) rounds of whole-array operations cover every path. Depths come from the
same pointer doubling, summing the jumped distances (``ragged_depths``).

``ancestor_bits_and_depths`` gives both at once; for a decode step's few hundred nodes it walks the nodes
in one Python loop instead (a node's row is its parent's row plus its own bit), which costs less there
than the whole-array passes' dozens of numpy calls.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SMALL_BATCH_NODES", "ancestor_bits_and_depths", "ragged_ancestor_bits", "ragged_depths",
           "walked_in_one_pass"]

SMALL_BATCH_NODES = 512  # ancestor_bits_and_depths loops over the nodes up to this many (trees of <= 64 nodes)


def ragged_ancestor_bits(parents: np.ndarray, cu_nodes: np.ndarray, words: int | None = None) -> np.ndarray:
    """[T, words] int64 ancestor-or-self bitmasks of the trees in a ragged batch.

    parents: [T] local parents (-1 at each root, else 0 <= parent < local index);
    cu_nodes: [R + 1] prefix sums of the node counts (every tree non-empty);
    words: words per row (default ceil(largest tree / 64); must cover the largest tree).
    Raises ValueError naming the first malformed entry.
    """
    par = np.asarray(parents, dtype=np.int64)
    cu = np.asarray(cu_nodes, dtype=np.int64)
    sizes = _checked_sizes(par, cu)
    total = par.shape[0]
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
        raise _invalid_parent(i, int(par[i]), int(local[i]))
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


def _checked_sizes(par: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """The trees' node counts; ValueError on malformed shapes or offsets, or an empty tree."""
    if par.ndim != 1 or cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"parents must be [T] and cu_nodes [R + 1], got shapes {par.shape} and {cu.shape}")
    total = par.shape[0]
    sizes = np.diff(cu)
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_nodes must start at 0 and end at the number of nodes {total}, got {int(cu[0])}..{int(cu[-1])}")
    if (sizes <= 0).any():
        r = int(np.nonzero(sizes <= 0)[0][0])
        raise ValueError(f"tree {r} has {int(sizes[r])} nodes; every tree needs at least its root")
    return sizes


def _invalid_parent(i: int, parent: int, local: int) -> ValueError:
    return ValueError(
        f"parents[{i}] = {parent} is invalid for local node {local}: "
        "the root needs -1 and every other node 0 <= parent < its local index"
    )


def walked_in_one_pass(num_nodes: int, largest_tree: int) -> bool:
    """Whether ``ancestor_bits_and_depths`` walks a batch of this size in its one Python pass (else it
    runs the whole-array functions, whose bitmasks cost more than the depths alone)."""
    return 0 < num_nodes <= SMALL_BATCH_NODES and largest_tree <= 64


def ancestor_bits_and_depths(parents: np.ndarray, cu_nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``ragged_ancestor_bits(parents, cu_nodes)``, ``ragged_depths(parents, cu_nodes)``), the same arrays.

    Batches of at most ``SMALL_BATCH_NODES`` nodes in trees of at most 64 (a decode step's trees, one word
    per row) are walked in one Python loop over the nodes: a node's row is its parent's row plus its own
    bit, its depth its parent's plus one; there that costs a fraction of the two whole-array functions'
    dozens of numpy calls (bench/NOTES.md section 36). Other batches take those functions. Raises
    ``ragged_ancestor_bits``' ValueErrors.
    """
    par = np.asarray(parents, dtype=np.int64)
    cu = np.asarray(cu_nodes, dtype=np.int64)
    sizes = _checked_sizes(par, cu)
    total = par.shape[0]
    if not walked_in_one_pass(total, int(sizes.max()) if sizes.size else 0):
        return ragged_ancestor_bits(par, cu), ragged_depths(par, cu)
    pl = par.tolist()
    bits = [0] * total
    depth = [0] * total
    i = 0
    for start, size in zip(cu[:-1].tolist(), sizes.tolist()):
        if pl[i] != -1:
            raise _invalid_parent(i, pl[i], 0)
        bits[i] = 1
        i += 1
        for local in range(1, size):
            p = pl[i]
            if p < 0 or p >= local:
                raise _invalid_parent(i, p, local)
            up = start + p
            bits[i] = bits[up] | (1 << local)
            depth[i] = depth[up] + 1
            i += 1
    return np.array(bits, dtype=np.uint64).view(np.int64).reshape(total, 1), np.array(depth, dtype=np.int64)


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

"""Index tables of a ragged tree batch for the vectorised tree walks, built on the host.

The verifiers walk root-to-node paths. Walking them with a loop over depths costs a dozen torch
calls per depth, and each call reads the batch's largest depth or children count back from the
device. The tree *shape* (parents, node counts) is known on the host before a decode step runs
(the runtime keeps it in numpy), so everything that depends only on the shape is computed there
once, with whole-array numpy operations, and copied to the device in one transfer:

* ``children`` [T, C]: flat indices of each node's children in index order, -1 padding
  (C = max(largest number of children, 1));
* ``paths`` [T, Dmax + 1]: ``paths[i, d]`` is the flat index of node i's ancestor at depth d
  (node i itself at its own depth), -1 past it; the root..i path is one row;
* ``deepest`` [R]: flat index of each request's first node (lowest index) of maximal depth;
* ``starts`` [R], ``node_request`` [T], ``global_parents`` [T] (-1 at roots);
* ``max_depth``: Dmax as a host int.

``tree_table_arrays`` gives the numpy arrays (the runtime packs them with the rest of its step
upload), :meth:`TreeTables.from_host` builds and uploads them, :meth:`TreeTables.of` takes a
``TreeBatch`` whose tensors live on the device (one device-to-host read of its shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.tree.bitmask import ragged_depths
from vllm_tfm.tree.types import TreeBatch

from .packed_upload import packed_upload

__all__ = ["TABLE_NAMES", "TreeTables", "tree_table_arrays"]

TABLE_NAMES = ("starts", "node_request", "global_parents", "children", "paths", "deepest")


def tree_table_arrays(
    parents: np.ndarray, cu_nodes: np.ndarray, depth: np.ndarray | None = None
) -> tuple[int, dict[str, np.ndarray]]:
    """(Dmax, {name: int64 array}) of a ragged batch (module docstring), numpy only.

    parents: [T] local parents (-1 at each root, topological order); cu_nodes: [R + 1]; depth:
    [T] when the caller has it (else computed).
    """
    par = np.asarray(parents, dtype=np.int64)
    cu = np.asarray(cu_nodes, dtype=np.int64)
    t, r = par.shape[0], cu.shape[0] - 1
    sizes = np.diff(cu)
    dep = ragged_depths(par, cu) if depth is None else np.asarray(depth, dtype=np.int64)
    starts = cu[:-1]
    node_request = np.repeat(np.arange(r, dtype=np.int64), sizes)
    gp = np.where(par >= 0, par + starts[node_request], -1)
    dmax = int(dep.max()) if t else 0
    # children: the non-root nodes grouped by parent (stable: index order within a parent)
    child = np.nonzero(gp >= 0)[0]
    parent = gp[child]
    counts = np.bincount(parent, minlength=t)
    order = np.argsort(parent, kind="stable")
    parent, child = parent[order], child[order]
    slot = np.arange(child.shape[0]) - (np.cumsum(counts) - counts)[parent]
    children = np.full((t, max(int(counts.max()) if child.size else 0, 1)), -1, dtype=np.int64)
    children[parent, slot] = child
    # paths: walk every node up at once, writing the ancestor j steps up at column depth - j
    paths = np.full((t, dmax + 1), -1, dtype=np.int64)
    rows = np.arange(t, dtype=np.int64)
    anc = rows.copy()
    col = dep.copy()
    while rows.size:
        paths[rows, col] = anc
        up = gp[anc]
        keep = up >= 0
        rows, anc, col = rows[keep], up[keep], col[keep] - 1
    # deepest: first node of maximal depth of each request
    key = dep * (t + 1) + (t - np.arange(t))  # deeper first, then earlier
    deepest = t - np.maximum.reduceat(key, starts) % (t + 1) if r and t else np.zeros(r, dtype=np.int64)
    return dmax, {"starts": starts, "node_request": node_request, "global_parents": gp, "children": children,
                  "paths": paths, "deepest": deepest}


@dataclass(frozen=True)
class TreeTables:
    """Device index tables of one ragged batch (module docstring); read-only."""

    max_depth: int
    starts: Tensor
    node_request: Tensor
    global_parents: Tensor
    children: Tensor
    paths: Tensor
    deepest: Tensor

    @property
    def num_requests(self) -> int:
        return int(self.starts.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.node_request.shape[0])

    @property
    def max_children(self) -> int:
        """Columns of ``children`` (at least 1)."""
        return int(self.children.shape[1])

    @staticmethod
    def from_arrays(max_depth: int, tensors: Mapping[str, Tensor]) -> TreeTables:
        """From the device copies of :func:`tree_table_arrays`' arrays."""
        return TreeTables(max_depth, *(tensors[n] for n in TABLE_NAMES))

    @staticmethod
    def from_host(
        parents: np.ndarray, cu_nodes: np.ndarray, device: torch.device | str, depth: np.ndarray | None = None
    ) -> TreeTables:
        """Build on the host and copy to ``device`` in one transfer."""
        dmax, arrays = tree_table_arrays(parents, cu_nodes, depth)
        return TreeTables.from_arrays(dmax, packed_upload(arrays, device))

    @staticmethod
    def of(trees: TreeBatch) -> TreeTables:
        """The tables of a batch whose shape lives on the device (reads parents and cu_nodes once)."""
        return TreeTables.from_host(trees.parents.cpu().numpy(), trees.cu_nodes.cpu().numpy(), trees.tokens.device)

    def check(self, trees: TreeBatch) -> None:
        """ValueError unless the tables describe a batch of ``trees``' size (node and request counts)."""
        if self.num_nodes != trees.num_nodes or self.num_requests != trees.num_requests:
            raise ValueError(
                f"tree tables of {self.num_requests} requests / {self.num_nodes} nodes do not belong to a batch of "
                f"{trees.num_requests} requests / {trees.num_nodes} nodes"
            )

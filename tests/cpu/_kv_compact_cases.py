"""K/V compaction problems for the tests of ``vllm_tfm.kernels.kv_compact`` (CPU emulation and GPU).

A problem is what ``runtime/commit.py`` hands ``compact_kv`` after a tree step: the caches of one
KV-cache group (TRITON_ATTN, logical [num_blocks, H, block_size, 2 * head_size]) in one of several
physical layouts, the step's slot mapping (each request's rows at positions ctx .. ctx + n - 1 of its
own randomly ordered blocks, so rows cross block boundaries and blocks are not contiguous; padding
rows -1 at the end, as vLLM pads), and the row lists of ``compaction_rows`` for accepted paths taken
from random trees. Expected results always come from the torch reference on a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from _trees import path_of, random_tree_parents
from torch import Tensor

from vllm_tfm.vllm_plugin.runtime.commit import compaction_rows

LAYOUTS = ("NHD", "HND", "strided_last", "padded8", "padded2", "cross_layer")


def make_caches(layout: str, layers: int, num_blocks: int, heads: int, block_size: int, width: int,
                dtype: torch.dtype, gen: torch.Generator) -> list[Tensor]:
    """``layers`` caches, logical [num_blocks, heads, block_size, width], random values made on the
    generator's device.

    NHD: vLLM's default physical order [blocks, block_size, H, width]; HND: the logical order;
    strided_last: the last dimension strided ([blocks, width, block_size, H] in memory: one-element
    copies); padded8 / padded2: rows padded past ``width`` so that the strides are multiples of 8 / 2
    bytes but not 16 (narrower copy units); cross_layer: every layer a view of one buffer
    [blocks, layers, block_size, H, width] (vLLM's cross-layer layout)."""
    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=gen.device).to(dtype)

    if layout == "cross_layer":
        buf = rnd(num_blocks, layers, block_size, heads, width)
        return [buf[:, i].permute(0, 2, 1, 3) for i in range(layers)]
    out = []
    for _ in range(layers):
        if layout == "NHD":
            kv = rnd(num_blocks, block_size, heads, width).permute(0, 2, 1, 3)
        elif layout == "HND":
            kv = rnd(num_blocks, heads, block_size, width)
        elif layout == "strided_last":
            kv = rnd(num_blocks, width, block_size, heads).permute(0, 3, 2, 1)
        elif layout in ("padded8", "padded2"):
            es = torch.empty(0, dtype=dtype).element_size()
            pad = (8 // es if 8 % es == 0 and 8 // es > 0 else 1) if layout == "padded8" else 1
            kv = rnd(num_blocks, block_size, heads, width + pad)[..., :width].permute(0, 2, 1, 3)
        else:
            raise ValueError(f"unknown layout {layout!r}")
        out.append(kv)
    return out


@dataclass(frozen=True)
class Request:
    """A tree request of ``nodes`` rows after ``ctx`` tokens, accepting a path of (up to) ``accept``
    drafts in a tree of ``kind`` (``tests/cpu/_trees.py``); accept = -1: the deepest path."""

    nodes: int
    ctx: int
    accept: int
    kind: str = "random"


def accepted_path(req: Request, gen: torch.Generator) -> list[int]:
    """Local indices of the accepted drafts (root excluded), root..leaf order, of a random node at the
    requested depth (the deepest when the tree is not that deep)."""
    parents = random_tree_parents(req.nodes, gen, req.kind)
    depths = [len(path_of(parents, i)) - 1 for i in range(req.nodes)]
    want = max(depths) if req.accept < 0 else min(req.accept, max(depths))
    nodes = [i for i, d in enumerate(depths) if d == want]
    node = nodes[int(torch.randint(0, len(nodes), (1,), generator=gen))]
    return path_of(parents, node)[1:]


def step_slots(reqs: list[Request], block_size: int, gen: torch.Generator, spare_blocks: int = 3,
               pad_rows: int = 2) -> tuple[Tensor, Tensor, int]:
    """(slot_mapping [T + pad_rows] int64, row_base [R] int64, num_blocks): each request's blocks are a
    random selection of the cache's blocks in random order; the slot of position p is
    ``table[p // block_size] * block_size + p % block_size``."""
    need = [-(-(r.ctx + r.nodes) // block_size) for r in reqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    slots, base, start = [], [], 0
    for r, k in zip(reqs, need):
        table, start = perm[start : start + k], start + k
        base.append(len(slots))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(r.ctx, r.ctx + r.nodes)]
    slots += [-1] * pad_rows
    return torch.tensor(slots, dtype=torch.int64), torch.tensor(base, dtype=torch.int64), num_blocks


def path_rows(reqs: list[Request], row_base: Tensor, dmax: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``compaction_rows`` of random accepted paths (padded with -1 to ``dmax``)."""
    acc = torch.full((len(reqs), dmax), -1, dtype=torch.int64)
    for i, r in enumerate(reqs):
        path = accepted_path(r, gen)[:dmax]
        acc[i, : len(path)] = torch.tensor(path, dtype=torch.int64)
    return compaction_rows(row_base, acc)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(kv: Tensor) -> Tensor:
    """The same memory as an integer tensor of the same element size and strides: the reference run
    on it moves the very bytes (whether or not the device's index kernels take the float dtype)."""
    return kv.view(_BITS[kv.element_size()])


def as_bytes(kv: Tensor) -> Tensor:
    """The cache's bytes in logical order (bitwise comparison, whatever the dtype)."""
    return kv.contiguous().view(torch.uint8)

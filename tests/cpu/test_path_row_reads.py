"""bench/path_row_reads.py: wavefronts of version 8's path-row X reads, on trees whose counts follow by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import path_row_reads as prr

from vllm_tfm.kernels.plan import TreePlan


def test_star_of_32_leaves():
    # root (position 0, entry 0) and leaves at positions 1 .. 32 (entries 2p - 1, 2p): leaf p reads X[2p - 1] once.
    # Warp 0 (root, leaves 1 .. 31): words 1, 3, .., 61, banks 1 .. 31 odd, 1 .. 29 twice: one read, 2 wavefronts.
    # Warp 1 (leaf 32): word 63, one wavefront. Level order is node order here.
    plan = TreePlan.build(torch.tensor([-1] + [0] * 32), torch.tensor([0, 33]), device="cpu")
    for level in (False, True):
        assert prr.count(plan, 0, 1, level) == dict(warp_reads=2, wavefronts=3, lane_reads=32)


def test_chain_of_four_with_two_value_heads():
    # node i (depth i) reads i (i - 1) / 2 words, one lane a node in one warp: the deepest node's 3 + 2 + 1 slots, 0 +
    # 1 + 3 + 6 lane reads; entries 0 .. 9, so every word of a read is in its own bank: a wavefront a read. A second
    # value head's products sit 12 words on (10 entries, aligned to 4): its lanes join the same reads, still one bank
    # a word
    plan = TreePlan.build(torch.tensor([-1, 0, 1, 2]), torch.tensor([0, 4]), device="cpu")
    assert prr.count(plan, 0, 1, False) == dict(warp_reads=6, wavefronts=6, lane_reads=10)
    assert prr.count(plan, 0, 2, False) == dict(warp_reads=6, wavefronts=6, lane_reads=20)

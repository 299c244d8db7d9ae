"""The greedy tree acceptance kernel (``cuda/tree_greedy_accept.cu``) on the CPU through the CUDA emulation,
against its reference (the torch path's ``greedy_walk``) and against a walk written out with Python loops:
every output entry equal, on random, chain, star and deep trees, single-node requests, mixed batches,
duplicate sibling tokens (the first child in index order wins), walks that end at the root and walks that
reach the deepest leaf, int32 and int64 drafts, vLLM's int32 layout wider than the trees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _emulation import emulated, emulation_build_dir
from _greedy_cases import GREEDY_CASES, greedy_batch, greedy_loops

from vllm_tfm.kernels import greedy_accept as kga


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_greedy_accept")


@pytest.mark.parametrize("sizes_kinds,follow", GREEDY_CASES)
@pytest.mark.parametrize("drafts_dtype", [torch.int32, torch.int64])
def test_kernel_equals_reference_and_loops(emu_dir, sizes_kinds, follow, drafts_dtype):
    for seed in range(3):
        target, parents, cu, drafts, dmax, max_nodes, tokens = greedy_batch(sizes_kinds, seed, follow, drafts_dtype)
        cols = dmax + 1 + 2  # vLLM's max_spec_len + 1 can exceed the batch's depth
        with emulated(emu_dir) as launches:
            got, sampled = kga.tree_greedy_accept(target, parents, cu, drafts, dmax, cols, max_nodes)
        assert [name for name, _, _ in launches] == ["tree_greedy_accept"]
        ref, ref_sampled = kga.tree_greedy_accept_reference(target, parents, cu, drafts, dmax, cols, max_nodes)
        for f in ("accepted_nodes", "num_accepted", "last_node", "bonus", "output_tokens"):
            assert getattr(got, f).dtype == torch.int64
            assert torch.equal(getattr(got, f), getattr(ref, f)), f
        assert sampled.dtype == torch.int32 and torch.equal(sampled, ref_sampled)
        acc, num, last, bonus, out = greedy_loops(target, parents, cu, tokens, dmax, cols)
        assert np.array_equal(got.accepted_nodes.numpy(), acc)
        assert np.array_equal(got.num_accepted.numpy(), num) and np.array_equal(got.last_node.numpy(), last)
        assert np.array_equal(got.bonus.numpy(), bonus) and np.array_equal(sampled.numpy(), out)


def test_duplicate_sibling_tokens_take_the_first_child(emu_dir):
    """Root with children 1, 2, 3 carrying tokens 5, 4, 4; argmax 4 at the root: node 2, not 3."""
    parents = torch.tensor([-1, 0, 0, 0, 3, 2])
    tokens = torch.tensor([0, 5, 4, 4, 9, 6])
    target = torch.tensor([4, 0, 6, 9, 0, 1])
    cu = torch.tensor([0, 6])
    drafts = tokens[1:].clone()
    with emulated(emu_dir):
        got, sampled = kga.tree_greedy_accept(target, parents, cu, drafts, 2, 3, 6)
    assert got.accepted_nodes.tolist() == [[2, 5]] and int(got.bonus[0]) == 1
    assert sampled.tolist() == [[4, 6, 1]]


def test_bad_arguments_are_refused_with_their_reason():
    target, parents, cu, drafts, dmax, max_nodes, _ = greedy_batch([(17, "random")], 0, 0.9, torch.int32)
    with pytest.raises(ValueError, match="sampled_cols = 3 < dmax"):
        kga.tree_greedy_accept(target, parents, cu, drafts, 4, 3, max_nodes)
    with pytest.raises(ValueError, match="drafts must be a contiguous int32 or int64"):
        kga.tree_greedy_accept(target, parents, cu, drafts[1:], dmax, dmax + 1, max_nodes)
    with pytest.raises(ValueError, match="2000 nodes in a tree: the kernel takes 1 to 1024"):
        kga.tree_greedy_accept(target, parents, cu, drafts, dmax, dmax + 1, 2000)
    assert kga.unsupported_reason(target, parents, cu, drafts, dmax, dmax + 1, max_nodes) == kga.NOT_CUDA

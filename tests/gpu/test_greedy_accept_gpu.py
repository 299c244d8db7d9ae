"""GPU test: the one-launch greedy tree acceptance (``cuda/tree_greedy_accept.cu``) gives the torch path's result
(``tree_greedy_accept_reference``: ``vllm_tfm.verify.sampling.greedy_walk``) entry for entry, on the shared
cases (random, chain, star, deep and one-node trees, mixed batches, duplicate sibling tokens, walks to the root
and to the deepest leaf, int32 and int64 drafts) and at the 27B tree step's shapes from bf16 logits of a 248,320
vocabulary (batch 1 and 8, B = 16); its launch reads nothing back to the host.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_greedy_accept_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_marks import KERNEL_GPU_MARKS
from _greedy_cases import GREEDY_CASES, greedy_batch, greedy_loops, planted_step

from vllm_tfm.kernels import greedy_accept as kga
from vllm_tfm.tree.bitmask import ragged_depths

pytestmark = KERNEL_GPU_MARKS

DEV = torch.device("cuda")


def _check(target, parents, cu, drafts, dmax, cols, max_nodes):
    assert kga.unsupported_reason(target, parents, cu, drafts, dmax, cols, max_nodes) is None
    torch.cuda.synchronize()
    got, sampled = kga.tree_greedy_accept(target, parents, cu, drafts, dmax, cols, max_nodes)
    ref, ref_sampled = kga.tree_greedy_accept_reference(target, parents, cu, drafts, dmax, cols, max_nodes)
    for f in ("accepted_nodes", "num_accepted", "last_node", "bonus", "output_tokens"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert sampled.dtype == torch.int32 and torch.equal(sampled, ref_sampled)
    return got, sampled


@pytest.mark.parametrize("sizes_kinds,follow", GREEDY_CASES)
@pytest.mark.parametrize("drafts_dtype", [torch.int32, torch.int64])
def test_kernel_equals_reference_and_loops(sizes_kinds, follow, drafts_dtype):
    for seed in range(4):
        target, parents, cu, drafts, dmax, max_nodes, tokens = greedy_batch(sizes_kinds, seed, follow, drafts_dtype)
        cols = dmax + 3
        got, sampled = _check(target.to(DEV), parents.to(DEV), cu.to(DEV), drafts.to(DEV), dmax, cols, max_nodes)
        acc, num, last, bonus, out = greedy_loops(target, parents, cu, tokens, dmax, cols)
        assert got.accepted_nodes.cpu().tolist() == acc.tolist() and sampled.cpu().tolist() == out.tolist()
        assert got.num_accepted.cpu().tolist() == num.tolist() and got.bonus.cpu().tolist() == bonus.tolist()


@pytest.mark.parametrize("r", [1, 8])
def test_27b_step_from_bf16_logits(r):
    """R requests of B = 16 drafts (17 nodes), bf16 logits over 248,320 tokens with planted argmaxes along a
    random path, int32 drafts as vLLM gives them; vLLM's sampled layout is [R, 17]."""
    vocab, n = 248320, 17
    logits, parents, tokens = planted_step(r, n, vocab, seed=r)
    logits = logits.to(torch.bfloat16)
    cu = torch.arange(r + 1, dtype=torch.int64) * n
    drafts = tokens[parents >= 0].to(torch.int32)
    dmax = int(ragged_depths(parents.numpy(), cu.numpy()).max())
    target = logits.to(DEV).argmax(dim=-1)
    dev = parents.to(DEV), cu.to(DEV), drafts.to(DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host synchronisation inside the call raises
    try:
        kga.tree_greedy_accept(target, *dev, dmax, n, n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got, _ = _check(target, *dev, dmax, n, n)
    assert int(got.num_accepted.sum()) > 0

"""GPU: the one-launch Weaver step (``cuda/weaver_step.cu``, ``vllm_tfm.kernels.weaver_step``) at the 27B drafter's
Weaver shape (d_model 5120, 3 layers, 8 heads of 128, MLP 3072) against the per-kernel path it replaces
(``weaver_linear`` + ``weaver_attention`` launches): the log-probabilities, every layer's K/V cache and the key-mask
rows equal bit for bit, FP8 and bfloat16 weights, R = 1 and 2, widths 1 and 2, the grid the device holds and a
smaller one (the stages' blocks looped over), and replayed from a CUDA graph.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_step_gpu.py -q``.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from _kernel_marks import CAPTURES_A_GRAPH, KERNEL_GPU_MARKS
from _weaver27b import VOCAB, scorers_27b

from vllm_tfm.kernels import weaver_step as ks

pytestmark = KERNEL_GPU_MARKS
DEV = torch.device("cuda")


def calls(r: int) -> list[tuple[torch.Tensor, ...]]:
    """(node ids, parent ids, tokens, depths, valid) of R requests: the roots, then two children, then two grandchildren
    each (the last request's last one invalid)."""
    g = torch.Generator(device="cpu").manual_seed(r)
    out = []
    for node, parent, dep in (([0], [-1], 0), ([1, 2], [0, 0], 1), ([3, 4], [2, 1], 2)):
        w = len(node)
        tok = torch.randint(0, VOCAB, (r, w), generator=g)
        valid = torch.ones(r, w, dtype=torch.bool)
        if dep == 2:
            valid[-1, -1] = False
        out.append(tuple(t.to(DEV) for t in (torch.tensor([node] * r), torch.tensor([parent] * r), tok,
                                                torch.full((r, w), dep), valid)))
    return out


def run(scorer, call, step: bool) -> torch.Tensor:
    with mock.patch.dict(os.environ, {ks.ENV_SWITCH: "1" if step else "0"}):
        return scorer(*call)


def same(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> bool:
    return torch.equal(a[valid], b[valid])


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("blocks", [None, 7])
def test_the_per_kernel_path_bit_for_bit(fp8: bool, r: int, blocks: int | None) -> None:
    base, twin = scorers_27b(r, (True, True), max_nodes=17, fp8=fp8)
    patch = mock.patch.object(ks, "max_resident_blocks", lambda k, t, s: blocks) if blocks else nullcontext()
    with patch:
        for call in calls(r):
            ref, got = run(base, call, False), run(twin, call, True)
            assert same(ref, got, call[4])
    assert all(f is not None and f[1] is None for f in twin._step_scratch.values())  # every call took the kernel
    for kv_a, kv_b in zip(base.kv_cache, twin.kv_cache):
        assert torch.equal(kv_a, kv_b)
    assert torch.equal(base.key_bias, twin.key_bias)


@CAPTURES_A_GRAPH
def test_replayed_from_a_cuda_graph() -> None:
    """The cooperative launch in a captured graph: each replay gives the eager call's log-probabilities."""
    base, twin = scorers_27b(1, (True, True), max_nodes=17, fp8=True)
    root, kids = calls(1)[:2]
    for s in (base, twin):
        run(s, root, s is twin)
    eager = run(base, kids, False)
    run(twin, kids, True)  # compiles and allocates the scratch outside the capture
    graph = torch.cuda.CUDAGraph()
    with mock.patch.dict(os.environ, {ks.ENV_SWITCH: "1"}), torch.cuda.graph(graph):
        out = twin(*kids)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)

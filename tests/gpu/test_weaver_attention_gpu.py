"""GPU: the Weaver scorer's node-attention kernel (``cuda/weaver_attention.cu``) against the float64
function of the same stored values and the torch reference it replaces (RoPE mul / addcmul, K/V
scatter, SDPA with the additive key mask, the output copy).

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_attention_gpu.py -q``. Fresh random
problems at the 27B drafter's layer shape (8 heads of 128, D = 15, 33 node slots) for R = 1 and 8
requests, w = 1, 2, 4 nodes per call, bfloat16 / float16 / float32; a deep chain and 130 node slots
(more keys than a CTA's lanes four times over); the dispatch takes the kernel on CUDA; and the
Weaver's log-probabilities through the scorer's kernels stay within bfloat16 rounding of the torch
path at the 27B shape over three calls; launched with programmatic dependent launch (with the candidate scores),
the plain launches' outputs bit for bit, eagerly and from a CUDA graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _kernel_marks import CAPTURES_A_GRAPH
from _weaver27b import VOCAB, scorer_pair_27b, scorers_27b

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _attention_problem import check_results, problem, run_on_copies, run_reference

from vllm_tfm.kernels import weaver_attention as ka

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
HEADS, HD, DEPTH, SLOTS = 8, 128, 15, 33


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("r", "w"), [(1, 1), (1, 2), (8, 2), (8, 4)])
def test_matches_float64_and_reference(dtype, r: int, w: int) -> None:
    args = problem(10 * r + w, r, w, HEADS, HD, DEPTH, SLOTS, dtype, device="cuda")
    assert ka.unsupported_reason(*args, True) is None
    check_results(args, True, run_on_copies(ka.node_attention_kernel, args, True), run_reference(args, True))
    check_results(args, False, run_on_copies(ka.node_attention_kernel, args, False), run_reference(args, False))


def test_roots_deep_chain_and_many_slots() -> None:
    for seed, kw in ((1, {"roots": True}), (2, {"chain": True, "invalid": 0.0}), (3, {})):
        args = problem(seed, 3, 4, HEADS, HD, DEPTH, 130, torch.bfloat16, device="cuda", **kw)
        check_results(args, True, run_on_copies(ka.node_attention_kernel, args, True), run_reference(args, True))


def test_dispatch_takes_the_kernel(monkeypatch) -> None:
    args = problem(4, 2, 2, HEADS, HD, DEPTH, SLOTS, torch.bfloat16, device="cuda")
    via, kern = run_on_copies(ka.node_attention, args, True), run_on_copies(ka.node_attention_kernel, args, True)
    assert all(torch.equal(a, b) for a, b in zip(via, kern))  # deterministic: the kernel ran
    monkeypatch.setenv(ka.ENV_SWITCH, "0")
    off, ref = run_on_copies(ka.node_attention, args, True), run_reference(args, True)
    assert all(torch.equal(a, b) for a, b in zip(off, ref))


def three_calls(r: int) -> list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]]:
    """(node ids, parent ids, depth, valid) of three scorer calls of R requests at w = 2: the roots (one invalid
    column), their children, grandchildren under different parents."""
    w = 2
    return [
        (torch.zeros(r, w, dtype=torch.long, device=DEV), torch.full((r, w), -1, device=DEV), 0,
         torch.tensor([[True, False]] * r, device=DEV)),
        (torch.tensor([[1, 2]] * r, device=DEV), torch.zeros(r, w, dtype=torch.long, device=DEV), 1,
         torch.ones(r, w, dtype=torch.bool, device=DEV)),
        (torch.tensor([[3, 4]] * r, device=DEV), torch.tensor([[1, 2]] * r, device=DEV), 2,
         torch.ones(r, w, dtype=torch.bool, device=DEV)),
    ]


def test_weaver_scorer_at_the_27b_shape(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_TFM_WEAVER_LINEAR_KERNEL", "0")  # the attention (and candidate) kernels differ
    r, w = 2, 2
    scorers = scorer_pair_27b(r)
    tok = torch.randint(0, VOCAB, (r, w), device=DEV)
    calls = three_calls(r)
    with torch.inference_mode():
        for node, parent, depth, valid in calls:
            ref, got = (s(node, parent, tok, torch.full_like(node, depth), valid) for s in scorers)
            p_ref, p_got = ref.exp()[valid], got.exp()[valid]
            assert float((p_ref - p_got).abs().sum(-1).max()) <= 0.05  # total variation of the 512-way softmax


def chain_pdl_pair(monkeypatch, fp8: bool, r: int = 2, w: int = 2):
    """Two kernel-path scorers of one 27B-shape Weaver after three_calls(r): the first with VLLM_TFM_WEAVER_CHAIN_PDL=0,
    the second with it on; (scorers, the calls' token ids, each call's outputs off and on)."""
    off_s, on_s = scorers_27b(r, (True, True), max_nodes=17, fp8=fp8)
    tok = torch.randint(0, VOCAB, (r, w), device=DEV)
    outs = []
    with torch.inference_mode():
        for node, parent, depth, valid in three_calls(r):
            args = (node, parent, tok, torch.full_like(node, depth), valid)
            monkeypatch.setenv(ka.CHAIN_PDL_SWITCH, "0")
            ref = off_s(*args)
            monkeypatch.setenv(ka.CHAIN_PDL_SWITCH, "1")
            outs.append((ref, on_s(*args), valid))
    return (off_s, on_s), tok, outs


@pytest.mark.parametrize("fp8", [True, False])
def test_chain_pdl_gives_the_plain_launches_outputs(monkeypatch, fp8: bool) -> None:
    """The attention and candidate-score kernels launched with programmatic dependent launch (each may start while the
    linear before it runs: VLLM_TFM_WEAVER_CHAIN_PDL) give the plain launches' log-probabilities, K/V caches and
    key-mask rows bit for bit over three calls at the 27B shape."""
    (off_s, on_s), _, outs = chain_pdl_pair(monkeypatch, fp8)
    for ref, got, valid in outs:
        assert torch.equal(ref[valid], got[valid])
    for a, b in zip(off_s.kv_cache, on_s.kv_cache):
        assert torch.equal(a, b)
    assert torch.equal(off_s.key_bias, on_s.key_bias)


@CAPTURES_A_GRAPH
def test_chain_pdl_replayed_from_a_cuda_graph(monkeypatch) -> None:
    """A fourth call with the chain's PDL launches captured in a CUDA graph: each replay gives the plain launches'
    eager log-probabilities."""
    r, w = 2, 2
    (off_s, on_s), tok, _ = chain_pdl_pair(monkeypatch, True, r, w)
    args = (torch.tensor([[5, 6]] * r, device=DEV), torch.tensor([[3, 4]] * r, device=DEV), tok,
            torch.full((r, w), 3, device=DEV), torch.ones(r, w, dtype=torch.bool, device=DEV))
    with torch.inference_mode():
        monkeypatch.setenv(ka.CHAIN_PDL_SWITCH, "0")
        eager = off_s(*args)
        monkeypatch.setenv(ka.CHAIN_PDL_SWITCH, "1")
        on_s(*args)  # the kernels compiled and loaded outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = on_s(*args)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)

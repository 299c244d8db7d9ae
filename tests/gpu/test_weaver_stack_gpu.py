"""GPU: the Weaver stack kernel (``cuda/weaver_stack.cu``, one cooperative launch per scorer call)
at the 27B drafter shape (d_model 5120, d_rank 1024, 3 layers of 8 heads of 128, d_mlp 3072,
bfloat16): bit for bit the per-op kernels (``weaver_linear`` with one warp per unit,
``weaver_node_attention``) in the log-probabilities, every layer's K/V cache and the key-mask rows
over three scorer calls, at R w = 1, 2, 4 and 16 rows; replayed from a CUDA graph on new inputs; and
the dispatch's refusals.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_stack_gpu.py -q``.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from _weaver27b import DEPTH, HIDDEN, VOCAB, scorers_27b

from vllm_tfm.kernels import weaver_linear as kl
from vllm_tfm.kernels import weaver_stack as ks
from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
SLOTS = 33


def kernel_scorers(r: int, count: int, seed: int = 0) -> list[BatchedWeaverTreeScorer]:
    """``count`` kernel-path scorers of R requests on one random bfloat16 Weaver and the same inputs."""
    return scorers_27b(r, (True,) * count, SLOTS, seed)


def calls(r: int, w: int) -> list[tuple[torch.Tensor, ...]]:
    """Roots (one valid column), w children of each root, then w grandchildren (the last row invalid)."""
    ones = torch.ones(r, w, dtype=torch.bool, device=DEV)
    col = torch.arange(w, device=DEV).expand(r, w)
    grand_valid = ones.clone()
    grand_valid[-1, -1] = False
    tok = torch.randint(0, VOCAB, (3, r, w), device=DEV)
    return [
        (torch.zeros(r, w, dtype=torch.long, device=DEV), torch.full((r, w), -1, device=DEV), tok[0],
         torch.zeros(r, w, dtype=torch.long, device=DEV), col == 0),
        (1 + col, torch.zeros(r, w, dtype=torch.long, device=DEV), tok[1], torch.ones(r, w, dtype=torch.long, device=DEV),
         ones),
        (1 + w + col, 1 + col.flip(1), tok[2], torch.full((r, w), 2, device=DEV), grand_valid),
    ]


@pytest.mark.parametrize(("r", "w"), [(1, 1), (1, 2), (2, 2), (8, 2)])
def test_stack_equals_the_per_op_kernels(r: int, w: int, monkeypatch) -> None:
    per_op, stacked = kernel_scorers(r, 2, seed=r * 10 + w)
    ran = []
    real = ks.weaver_stack_kernel
    with (torch.inference_mode(), mock.patch.object(kl, "k_split", lambda units, k: 1),
          mock.patch.object(kl, "KERNEL_ROWS", ks.MAX_ROWS),
          mock.patch.object(ks, "weaver_stack_kernel", lambda *a, **k: ran.append(1) or real(*a, **k))):
        for node, parent, tok, dep, valid in calls(r, w):
            monkeypatch.setenv(ks.ENV_SWITCH, "0")
            want = per_op(node, parent, tok, dep, valid)
            monkeypatch.setenv(ks.ENV_SWITCH, "1")
            got = stacked(node, parent, tok, dep, valid)
            assert torch.equal(got[valid], want[valid])
    assert len(ran) == 3
    for a, b in zip(per_op.kv_cache, stacked.kv_cache):
        assert torch.equal(a, b)
    assert torch.equal(per_op.key_bias, stacked.key_bias)


def test_stack_replays_from_a_cuda_graph(monkeypatch) -> None:
    r, w = 2, 2
    (scorer,) = kernel_scorers(r, 1, seed=5)
    monkeypatch.setenv(ks.ENV_SWITCH, "1")
    with torch.inference_mode():
        roots = calls(r, w)[0]
        scorer(*roots)  # the roots' K/V and mask rows, eagerly
        node, parent, tok, dep, valid = calls(r, w)[1]
        emb = torch.randn(r * w, HIDDEN, device=DEV).to(torch.bfloat16)
        args = [emb, None, scorer._rope_nodes, node.contiguous(), parent.contiguous(), dep.contiguous(),
                valid.contiguous(), scorer.kv_cache, scorer.key_bias, 1 + DEPTH,
                scorer.weaver.layers[0].head_dim ** -0.5]
        scorer._stack(*[emb, node, parent, dep, valid])  # builds the [N, K] weight views (and runs once)
        args[1] = scorer._stack_weights
        assert ks.unsupported_reason(*args) is None
        kv0 = [kv.clone() for kv in scorer.kv_cache]
        mask0 = scorer.key_bias.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ks.weaver_stack_kernel(*args)  # warm-up outside capture (compile, load)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ks.weaver_stack_kernel(*args)
        for trial in range(3):
            emb.copy_(torch.randn_like(emb, dtype=torch.float32).to(torch.bfloat16))
            for kv, k0 in zip(scorer.kv_cache, kv0):
                kv.copy_(k0)
            scorer.key_bias.copy_(mask0)
            graph.replay()
            replayed = out.clone()
            kv_graph = [kv.clone() for kv in scorer.kv_cache]
            for kv, k0 in zip(scorer.kv_cache, kv0):
                kv.copy_(k0)
            scorer.key_bias.copy_(mask0)
            eager = ks.weaver_stack_kernel(*args)
            assert torch.equal(replayed, eager), trial
            assert all(torch.equal(a, b) for a, b in zip(kv_graph, scorer.kv_cache)), trial


def test_dispatch(monkeypatch) -> None:
    (scorer,) = kernel_scorers(1, 1, seed=7)
    r, w = 1, 2
    node, parent, tok, dep, valid = calls(r, w)[0]
    with torch.inference_mode():
        monkeypatch.setenv(ks.ENV_SWITCH, "1")
        scorer(node, parent, tok, dep, valid)
        emb = torch.randn(r * w, HIDDEN, device=DEV).to(torch.bfloat16)
        args = [emb, scorer._stack_weights, scorer._rope_nodes, node, parent, dep, valid, scorer.kv_cache,
                scorer.key_bias, 1 + DEPTH, 128 ** -0.5]
        assert ks.unsupported_reason(*args) is None
        big = torch.zeros(17, HIDDEN, device=DEV, dtype=torch.bfloat16)
        nodes17 = torch.zeros(1, 17, dtype=torch.long, device=DEV)
        why = ks.unsupported_reason(big, *args[1:3], nodes17, nodes17, nodes17, nodes17.bool(), *args[7:])
        assert why is not None and "rows R w" in why
        assert ks.unsupported_reason(emb.float(), *args[1:]) is not None

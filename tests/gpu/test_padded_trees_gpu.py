"""GPU: the lockstep tree builders on CUDA equal the per-request builders on the CPU.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_padded_trees_gpu.py -q``. Checks what only
CUDA can break: stable sorts and int64 ``topk`` on the device, scatter into trash slots, the
batched Weaver scorer with bfloat16 weights (against the per-request scorer, call by call).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_tfm.models import BatchedWeaverTreeScorer, Weaver, WeaverConfig
from vllm_tfm.tree import (
    build_treeflash,
    build_treeflash_padded,
    build_weaver,
    build_weaver_padded,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
LEVELS = torch.tensor([0.0, -0.5, -1.0, -2.0, float("-inf")])


@pytest.mark.parametrize("n", [40, 5000])  # rows of <= 1024 entries sort; longer ones use topk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_builders_on_cuda_equal_per_request_builders_on_cpu(n, dtype):
    g = torch.Generator().manual_seed(n)
    r_, depth = 6, 4
    table = LEVELS[torch.randint(0, 5, (r_, depth, 7, n), generator=g)]  # ties everywhere
    table[..., 0] = -0.5
    table = table.to(dtype)
    cands = torch.stack([torch.stack([torch.randperm(3 * n, generator=g)[:n] for _ in range(depth)]) for _ in range(r_)])
    roots = list(range(3, 3 + r_))
    budgets, widths = [64, 9, 33, 1, 70, 20], [4, 3, 8, 1, 5, 2]
    tdev = table.to(DEV)
    rows = torch.arange(r_, device=DEV)[:, None]
    got = build_weaver_padded(
        roots, cands.to(DEV), lambda i, p, t, d, ok: tdev[rows, d.clamp(max=depth - 1), t % 7], budgets, depth, widths, 3
    )
    assert got.tokens.device.type == DEV.type
    for r in range(r_):
        ref = build_weaver(roots[r], cands[r], lambda i, p, t, d, r=r: table[r, d, t % 7], budgets[r], depth, widths[r], 3)
        tree = got.tree(r)
        assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
        assert tree.scores.cpu().tolist() == ref.scores.tolist()
    marg = table[:, :, 0].float().log_softmax(-1)
    got = build_treeflash_padded(roots, marg.to(DEV), lambda d, prev: tdev[rows, d - 1, prev % 7], budgets, depth, 5)
    for r in range(r_):
        ref = build_treeflash(roots[r], marg[r], lambda d, prev, r=r: table[r, d - 1, prev % 7], budgets[r], depth, 5)
        tree = got.tree(r)
        assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()


def test_batched_weaver_scorer_bf16_on_cuda_matches_the_per_request_scorer():
    torch.manual_seed(0)
    h, vocab, r_, depth, k, budget = 256, 1000, 4, 6, 64, 32
    w = Weaver(WeaverConfig(d_model=h, d_rank=128, n_layers=2, n_heads=4, d_mlp=256, max_depth=depth))
    w = w.to(DEV, torch.bfloat16).eval()
    embed = torch.randn(vocab, h, device=DEV).bfloat16()
    head = (torch.randn(vocab, h, device=DEV) * 0.05).bfloat16()
    logits = torch.randn(r_, depth, vocab, device=DEV) * 3
    hidden = torch.randn(r_, depth, h, device=DEV).bfloat16()
    verifier = torch.randn(r_, h, device=DEV).bfloat16()
    cl, cand = logits.topk(k, dim=-1)
    calls = []
    batched = BatchedWeaverTreeScorer(w, verifier, hidden, cand, cl, embed, head, max_nodes=1 + budget, validate=True)

    def recording(*args):
        out = batched(*args)
        calls.append(([a.clone() for a in args], out.clone()))
        return out

    build_weaver_padded(torch.arange(r_, device=DEV), cand, recording, budget, depth, math.ceil(budget / 8), 8)
    worst = 0.0
    for r in range(r_):
        single = w.tree_scorer(verifier[r], hidden[r], cand[r], cl[r], embed, head)
        for (ids, par, tok, dep, valid), out in calls:
            cols = valid[r].nonzero().flatten()
            if cols.numel():
                want = single(ids[r, cols], par[r, cols], tok[r, cols], dep[r, cols])
                worst = max(worst, float((out[r, cols] - want).abs().max()))
    assert worst < 0.05  # bf16 activations, float32 softmax: a few bf16 ulps of the logits

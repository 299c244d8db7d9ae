"""GPU: the Weaver round kernel (``cuda/weaver_round.cu``) against the torch round it replaces.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_round_gpu.py -q``. Fresh random
problems per case (a device scorer whose log-probabilities depend on each row's node, token and
depth: smooth, exact ties, mostly -inf; float32 / bfloat16 / float16 / float64), ragged limits,
n = 1, chains, stars, deep and wide trees: every round's outputs on the taken columns, the
frontier slots of real nodes, the node slots and the trees equal the torch round's exactly. Then
the real Weaver (zoo shape float32, 27B shape bfloat16): trees through the kernel == trees through
the torch round, eager and replayed from a CUDA graph.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_tfm.kernels import weaver_round as kw
from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.models.proposal_trees import weaver_draft_trees
from vllm_tfm.tree.weaver_padded import (
    RoundOutputs,
    WeaverGrowth,
    weaver_round_reference,
)
from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")


class DeviceScorer:
    """log-probabilities from a hash of (node id, token, depth, candidate index), on the device."""

    def __init__(self, k: int, kind: str, dtype: torch.dtype, seed: int) -> None:
        self.k, self.kind, self.dtype, self.seed = k, kind, dtype, seed
        self.cols = torch.arange(k, device=DEV)

    def __call__(self, ids, parents, tokens, depths, valid):
        h = (ids[..., None] * 1000003 + tokens[..., None] * 7919 + depths[..., None] * 104729
             + self.cols * 31337 + self.seed * 15485863) % 9973
        x = h.double() / 9973
        if self.kind == "ties":
            out = -torch.floor(x * 4)
        elif self.kind == "sparse":
            out = torch.where(x < 0.6, float("-inf"), -torch.floor(x * 5))
        else:
            out = torch.log_softmax(x * 6, dim=-1)
        out = out.to(self.dtype)
        return torch.where(valid[..., None], out, float("nan"))  # invalid rows must never be read


class Recording:
    def __init__(self, fn) -> None:
        self.fn, self.rounds = fn, []

    def __call__(self, g, *args) -> RoundOutputs:
        o = self.fn(g, *args)
        self.rounds.append(RoundOutputs(*(t.clone() for t in vars(o).values())))
        return o


def grow(roots, cands, scorer, budgets, depths, widths, cpn, kernel: bool):
    g = WeaverGrowth(roots, cands, scorer, budgets, depths, widths, cpn)
    rec = Recording(kw.KernelRound(g) if kernel else weaver_round_reference)
    g.round_fn = rec
    g.run_fixed()
    g.run_tail()
    return g, g.trees(), rec


def check_case(seed, r_, budgets, depths, widths, k, cpn, kind, dtype) -> None:
    gen = random.Random(seed)
    vocab = max(3 * k, 20)
    cands = torch.tensor([[gen.sample(range(vocab), k) for _ in range(max(depths))] for _ in range(r_)], device=DEV)
    roots = torch.tensor([gen.randrange(vocab) for _ in range(r_)], device=DEV)
    ga, ta, ra = grow(roots, cands, DeviceScorer(k, kind, dtype, seed), budgets, depths, widths, cpn, False)
    gb, tb, rb = grow(roots, cands, DeviceScorer(k, kind, dtype, seed), budgets, depths, widths, cpn, True)
    assert len(ra.rounds) == len(rb.rounds)
    for i, (a, b) in enumerate(zip(ra.rounds, rb.rounds)):
        for name in ("n_alive", "take", "room", "expand"):
            assert torch.equal(getattr(a, name), getattr(b, name)), f"round {i}: {name}"
        taken = torch.arange(a.node.shape[1], device=DEV)[None, :] < a.take[:, None]
        for name in ("node", "parent", "tok", "d", "depth_words", "score"):
            assert torch.equal(getattr(a, name)[taken], getattr(b, name)[taken]), f"round {i}: {name}"
    real = ga.trash_slot
    assert torch.equal(ga.fi[:, :real], gb.fi[:, :real]) and torch.equal(ga.ff[:, :real], gb.ff[:, :real])
    assert torch.equal(ga.node_slot[:, : ga.n_cap], gb.node_slot[:, : ga.n_cap])
    assert torch.equal(ga.left, gb.left) and bool(gb.fine)
    for name in ("tokens", "parents", "depth", "scores", "draft_logprobs", "num_nodes"):
        assert torch.equal(getattr(ta, name), getattr(tb, name)), name


@pytest.mark.parametrize("kind", ["smooth", "ties", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_kernel_rounds_equal_the_torch_rounds_on_random_problems(kind, dtype):
    gen = random.Random(f"{kind}-{dtype}")
    for case in range(8):
        r_ = gen.randint(1, 9)
        k = gen.choice([1, 3, 8, 37, 200, 512])
        cpn = gen.choice([1, 2, 8, 64])
        shared = gen.random() < 0.5
        w0 = gen.randint(1, 8)
        budgets = [gen.randint(1, 96) for _ in range(r_)]
        depths = [gen.randint(1, 15) for _ in range(r_)]
        widths = [w0 if shared else gen.randint(1, 8) for _ in range(r_)]
        check_case(gen.randrange(1 << 30), r_, budgets, depths, widths, k, cpn, kind, dtype)


@pytest.mark.parametrize(
    "shape",
    [
        ("n1", 1, [1], [3], [1], 8, 8),
        ("chain", 2, [15, 9], [15, 15], [1, 1], 4, 1),
        ("star", 1, [20], [1], [4], 33, 8),
        ("deep", 3, [64, 31, 48], [15, 15, 15], [1, 2, 4], 512, 8),
        ("wide", 2, [512, 200], [15, 15], [64, 13], 512, 8),
        ("batch32", 32, [32] * 32, [15] * 32, [2] * 32, 512, 8),
    ],
    ids=lambda s: s[0],
)
def test_kernel_rounds_on_edge_trees(shape):
    _, r_, budgets, depths, widths, k, cpn = shape
    check_case(hash(shape[0]) % 1000, r_, budgets, depths, widths, k, cpn, "smooth", torch.float32)


def weaver_inputs(r: int, h: int, vocab: int, cfg: WeaverConfig, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    w = Weaver(cfg)
    with torch.no_grad():
        for p in w.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    w = w.to(DEV, dtype).eval()
    embed = torch.randn(vocab, h, device=DEV).to(dtype)
    head = (torch.randn(vocab, h, device=DEV) * 0.05).to(dtype)
    d = cfg.max_depth
    logits = torch.randn(r, d, vocab, device=DEV) * 3
    hidden = torch.randn(r, d, h, device=DEV).to(dtype)
    verifier = torch.randn(r, h, device=DEV).to(dtype)
    roots = torch.randint(0, vocab, (r,), device=DEV)
    return w, logits, hidden, verifier, roots, embed, head


@pytest.mark.parametrize("shape", ["zoo_fp32", "27b_bf16"])
@pytest.mark.parametrize("r_", [1, 8])
def test_real_weaver_trees_through_the_kernel_equal_the_torch_round_eager_and_graphed(shape, r_):
    if shape == "zoo_fp32":
        h, vocab, dtype = 256, 4096, torch.float32
        cfg = WeaverConfig(d_model=h, d_rank=128, n_layers=2, n_heads=4, d_mlp=384, max_depth=15)
    else:
        h, vocab, dtype = 5120, 32768, torch.bfloat16
        cfg = WeaverConfig(d_model=h, max_depth=15)
    w, logits, hidden, verifier, roots, embed, head = weaver_inputs(r_, h, vocab, cfg, dtype, seed=r_)
    for budget in (32, 64):
        width = -(-budget // 16)
        args = (w, logits, hidden, verifier, roots, embed, head, budget, 512, width, 8)
        with torch.inference_mode():
            tok_ref, par_ref = weaver_draft_trees(*args, logits_dtype=dtype, round_kernel=False)
            tok_k, par_k = weaver_draft_trees(*args, logits_dtype=dtype, round_kernel=True)
            assert torch.equal(tok_ref, tok_k) and torch.equal(par_ref, par_k), f"B={budget}: eager"
            graphs = WeaverGraphs(buckets=(r_,))
            g_args = (w, logits, hidden, verifier, roots, embed, head, budget, 512, width, 8)
            graphs.weaver_trees(*g_args)  # capture
            tok_g, par_g = graphs.weaver_trees(*g_args)  # replay
            assert graphs.replays >= 1
            assert torch.equal(tok_ref, tok_g) and torch.equal(par_ref, par_g), f"B={budget}: graph replay"

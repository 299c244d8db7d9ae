"""GPU test: the rewritten tree sampler and commit equal their previous implementation on CUDA,
bit for bit (the CPU tests check the same on the CPU; here the CUDA kernels of torch and the
NVRTC commit kernels run): verification at the Qwen3.6 vocabulary, acceptance replay, and the
commit of a step (two attention layers, four GDN layers in two groups) with the real kernels.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_step_rewrite_gpu.py -q``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
import _step_before as before
from _trees import random_tree_parents

from vllm_tfm.tree.types import Tree, TreeBatch
from vllm_tfm.verify.acceptance_replay import pmf_cdf, replay_accept
from vllm_tfm.verify.logits_processing import TreeSamplingParams
from vllm_tfm.verify.sampling import verify_tree
from vllm_tfm.verify.tree_tables import TreeTables

DEV = torch.device("cuda")
FIELDS = ("accepted_nodes", "num_accepted", "last_node", "bonus", "output_tokens")


def _batch(num_req: int, n: int, vocab: int, g: torch.Generator) -> TreeBatch:
    kinds = ("deep", "random", "star", "chain")
    trees = [Tree.from_parents(torch.randint(0, vocab, (n,), generator=g), random_tree_parents(n, g, kinds[r % 4]))
             for r in range(num_req)]
    return TreeBatch.from_trees(trees).to(DEV)


def _same(a, b) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("num_req", [1, 8])
def test_verify_tree_on_cuda_equals_the_previous_code(num_req):
    g = torch.Generator().manual_seed(num_req)
    vocab = 248_320
    trees = _batch(num_req, 33, vocab, g)
    logits = (torch.randn(trees.num_nodes, vocab, generator=g) * 4).to(DEV)
    temps = np.array([0.0 if r % 3 == 1 else 1.0 for r in range(num_req)], dtype=np.float32)
    top_p = np.full(num_req, 0.95)
    host = TreeSamplingParams.from_host(temps, None, top_p, None, DEV)
    plain = before.tree_sampling_params_before(temps, None, top_p, None, DEV)
    u = torch.rand(num_req, int(trees.depth.max()) + 1, generator=g, dtype=torch.float64).to(DEV)
    want = before.verify_tree_before(logits, trees, plain, uniforms=u)
    _same(verify_tree(logits, trees, host, uniforms=u, tables=TreeTables.of(trees)), want)


def test_replay_on_cuda_equals_the_previous_code():
    g = torch.Generator().manual_seed(2)
    trees = _batch(8, 33, 1000, g)
    logits = torch.randn(trees.num_nodes, 1000, generator=g).to(DEV)
    u = torch.rand(8, generator=g, dtype=torch.float64).to(DEV)
    cdf = pmf_cdf([0.1] * 10, DEV)
    want, drawn, clamped = before.replay_accept_before(trees, logits, u, cdf)
    out = replay_accept(trees, logits, u, cdf, TreeTables.of(trees))
    _same(out.result, want)
    assert torch.equal(out.drawn, drawn) and torch.equal(out.clamped, clamped)


def test_commit_step_with_the_kernels_equals_the_previous_code():
    from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason

    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")
    from vllm_tfm.verify.accept_result import accept_result_from_last_node
    from vllm_tfm.vllm_plugin.runtime import hooks
    from vllm_tfm.vllm_plugin.runtime.gdn import spec_tree_gdn
    from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.state import STATE, ProposalStore
    from vllm_tfm.vllm_plugin.runtime.step_kernels import step_kernels

    b, h, k, hv, v, w = 16, 2, 64, 4, 32, 4
    conv_dim = 2 * h * k + hv * v
    results = []
    for impl in ("before", "after"):
        g = torch.Generator().manual_seed(5)
        kinds = ("deep", "random", "star", "chain")
        store = ProposalStore()
        ids = [f"r{i}" for i in range(4)]
        toks = torch.randint(0, 50, (4, b), generator=g)
        pars = torch.stack([random_tree_parents(b + 1, g, kind) for kind in kinds])
        store.put(ids, toks, pars)
        step = build_step_tree(["pre", *ids], np.array([3] + [b + 1] * 4), {i: toks[n].tolist() for n, i in enumerate(ids)},
                               store, allow_trees=True, device=DEV)
        kernels = step_kernels(step, DEV)
        assert kernels is not None
        slots_n = 4 * (1 + b) + 3
        tables = [torch.randperm(slots_n, generator=g)[: 4 * (1 + b)].view(4, 1 + b).to(torch.int32).to(DEV) for _ in range(2)]
        prev = torch.randint(1, b + 2, (4,), generator=g).to(torch.int32).to(DEV)
        states = []
        for layer in range(4):
            conv = torch.randn(slots_n, w - 1 + b, conv_dim, generator=g).to(DEV, torch.bfloat16).transpose(-1, -2)
            ssm = torch.randn(slots_n, hv, v, k, generator=g).to(DEV)
            x = torch.randn(step.num_spec_tokens, conv_dim, generator=g).to(DEV, torch.bfloat16)
            ab = torch.randn(step.num_spec_tokens, hv, generator=g).to(DEV, torch.bfloat16)
            _, stash = spec_tree_gdn(x, ab, ab, step.dev("spec_parents"), step.dev("spec_cu"), conv, ssm, tables[layer % 2],
                                     prev, (0.5 * torch.randn(conv_dim, w, generator=g)).to(DEV, torch.bfloat16), None, "silu",
                                     torch.rand(hv, generator=g).log().to(DEV), torch.randn(hv, generator=g).to(DEV),
                                     h, k, hv, v, kernels=kernels)
            step.gdn[f"layer{layer}"] = stash
            states.append((conv, ssm))
        kv = [torch.randn(40, 16, 4, 32, generator=g).to(DEV, torch.bfloat16).permute(0, 2, 1, 3) for _ in range(2)]
        st = step.sample_tables()
        trees = TreeBatch(torch.arange(int(step.sample_cu[-1]), device=DEV), step.dev("sample_parents"),
                          step.dev("sample_depth"), step.dev("sample_cu"))
        step.accept = accept_result_from_last_node(trees, st.deepest, torch.zeros_like(st.deepest), st)
        slot_mapping = torch.randperm(640, generator=g)[: step.num_tokens].to(DEV)
        runner = SimpleNamespace(_tfm_kv_groups=[(0, kv)], _tfm_num_gdn=4,
                                 input_batch=SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slot_mapping))]))
        STATE.metrics = Metrics(max_depth=b)
        untouched = [t.clone() for t in kv + [t for pair in states for t in pair]]
        (before.commit_step_before if impl == "before" else hooks.commit_step)(runner, step)
        torch.cuda.synchronize()
        results.append(kv + [t for pair in states for t in pair])
    assert all(not torch.equal(a, u) for a, u in zip(results[1], untouched))  # every cache and state was written
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)

"""GPU: CUDA-graph replays of the Weaver tree build equal the eager build.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_graphs_gpu.py -q``. A replay of a
bucket runs the eager build's kernels at R = bucket, so its trees must equal, exactly, the eager
build of the padded batch the graph read (the static inputs after the call); batches that need
growth rounds past the fixed ones (short frontiers) finish eagerly after the replay. A host sync
inside the captured part would make the capture itself fail.
"""

from __future__ import annotations

import pytest
import torch

from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import weaver_trees
from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
H, VOCAB, DEPTH = 256, 4096, 15


def weaver_and_tables(dtype: torch.dtype):
    """The zoo drafter's Weaver shape, random weights with some spread, random embed / lm_head."""
    torch.manual_seed(0)
    cfg = WeaverConfig(d_model=H, d_rank=128, n_layers=2, n_heads=4, d_mlp=384, max_depth=DEPTH)
    w = Weaver(cfg)
    with torch.no_grad():
        for p in w.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    w = w.to(DEV, dtype).eval()
    embed = torch.randn(VOCAB, H, device=DEV).to(dtype)
    head = (torch.randn(VOCAB, H, device=DEV) * 0.05).to(dtype)
    return w, embed, head


def drafter_outputs(r: int, head: torch.Tensor, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = torch.randn(r, DEPTH, H, generator=g, device=DEV).to(dtype)
    logits = (hidden.float() @ head.float().T) * 3
    verifier = torch.randn(r, H, generator=g, device=DEV).to(dtype)
    roots = torch.randint(0, VOCAB, (r,), generator=g, device=DEV, dtype=torch.int32)  # vLLM's dtype
    return logits, hidden, verifier, roots


def static_inputs(graphs: WeaverGraphs, bucket: int):
    (cap,) = [c for c in graphs._graphs.values() if c.inputs.bucket == bucket]
    return cap.inputs


def run_steps(dtype, batches, buckets, budget, top_k, width, cpn):
    w, embed, head = weaver_and_tables(dtype)
    graphs = WeaverGraphs(buckets)
    with torch.inference_mode():
        for step, r in enumerate(batches):
            logits, hidden, verifier, roots = drafter_outputs(r, head, dtype, seed=step)
            tok, par = graphs.weaver_trees(w, logits, hidden, verifier, roots, embed, head, budget, top_k, width, cpn)
            bucket = graphs.bucket(logits, embed, head)
            x = static_inputs(graphs, bucket)
            ref_tok, ref_par = weaver_trees(w, x.logits, x.hidden, x.verifier, x.roots, embed, head, budget, top_k, width, cpn)
            assert tok.shape == (r, budget) and par.shape == (r, 1 + budget)
            assert torch.equal(tok, ref_tok[:r]), f"step {step}: tokens"
            assert torch.equal(par, ref_par[:r]), f"step {step}: parents"
            if r == bucket:  # nothing padded: the eager build of the batch itself
                e_tok, e_par = weaver_trees(w, logits, hidden, verifier, roots, embed, head, budget, top_k, width, cpn)
                assert torch.equal(tok, e_tok) and torch.equal(par, e_par), f"step {step}: unpadded"
            assert int((par[:, 1:] >= 0).all()) == 1
    return graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [16, 64])
def test_graph_replays_equal_the_eager_build_of_the_padded_batch(dtype, budget):
    batches = [3, 8, 5, 8, 1, 4]  # buckets 4, 8, 8, 8, 4, 4: two captures, six replays
    graphs = run_steps(dtype, batches, (4, 8), budget, top_k=512, width=-(-budget // 16), cpn=8)
    assert len(graphs._graphs) == 2 and graphs.replays == len(batches) and graphs.eager_builds == 0


def test_short_frontiers_finish_eagerly_after_the_replay():
    # 2 children per node and 4 nodes per round: the first rounds place fewer than 4 nodes, so the
    # fixed ceil(B / w) rounds do not finish the trees; later replays still start from scratch
    graphs = run_steps(torch.float32, [4, 3, 4], (4,), budget=24, top_k=16, width=4, cpn=2)
    assert graphs.tail_rounds > 0 and graphs.replays == 3


def test_batches_past_the_largest_bucket_build_eagerly():
    w, embed, head = weaver_and_tables(torch.float32)
    graphs = WeaverGraphs((2,))
    logits, hidden, verifier, roots = drafter_outputs(3, head, torch.float32, seed=9)
    with torch.inference_mode():
        tok, par = graphs.weaver_trees(w, logits, hidden, verifier, roots, embed, head, 16, 64, 1, 8)
        ref = weaver_trees(w, logits, hidden, verifier, roots, embed, head, 16, 64, 1, 8)
    assert torch.equal(tok, ref[0]) and torch.equal(par, ref[1])
    assert (graphs.eager_builds, graphs.replays) == (1, 0)

"""GPU test: the batched Weaver scorer's fused form (``vllm_tfm/models/weaver_step.py``: the prompt pass
and the growth steps) on CUDA, against the unfused scorer (``tests/cpu/_weaver_unfused.py``) run in
float64 on the same device. The CPU test (``tests/cpu/test_weaver_fused_step.py``) holds the same bar
on the CPU; on CUDA other kernels run the float32 arithmetic (cuBLAS GEMMs, SDPA's backends, fused
norms), so the bar is checked there too: every call's float32 log-probabilities within 1e-5 of the
float64 function, and the same trees as the unfused float32 scorer on CUDA.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_fused_step_gpu.py -q -s`` (``-s`` prints
each case's worst errors).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _models import Recorder
from _weaver_unfused import BatchedWeaverTreeScorerUnfused
from test_weaver_fused_step import CASES, SHAPES, inputs, relative_error

from vllm_tfm.models import BatchedWeaverTreeScorer, Weaver
from vllm_tfm.tree import build_weaver_padded


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_scorer_on_cuda_matches_float64_and_keeps_the_trees(shape, case):
    r_, budget, width, top_k, cpn, depth = CASES[case]
    w, embed, head, logits, dh, vh, roots = inputs(shape, r_, depth, seed=10 * case + len(shape))
    dev = torch.device("cuda")
    w = w.to(dev)
    embed, head, logits, dh, vh, roots = (t.to(dev) for t in (embed, head, logits, dh, vh, roots))
    cl, cand = logits.topk(top_k, dim=-1)
    new = BatchedWeaverTreeScorer(w, vh, dh, cand, cl, embed, head, max_nodes=1 + budget)
    old = BatchedWeaverTreeScorerUnfused(w, vh, dh, cand, cl, embed, head, max_nodes=1 + budget)
    w64 = Weaver(w.config).double().eval().to(dev)
    w64.load_state_dict({k: v.double() for k, v in w.state_dict().items()})
    f64 = BatchedWeaverTreeScorerUnfused(w64, vh.double(), dh.double(), cand, cl.double(), embed.double(),
                                         head.double(), max_nodes=1 + budget)
    recs = {name: Recorder(s) for name, s in (("new", new), ("old", old), ("f64", f64))}
    trees = {name: build_weaver_padded(roots, cand, rec, budget, depth, width, cpn) for name, rec in recs.items()}
    worst = {"new": 0.0, "old": 0.0}
    for calls in zip(*(recs[n].calls for n in ("new", "old", "f64"))):
        a_ref, o_ref = calls[2]
        ok = a_ref[4]
        for name, (a, o) in zip(("new", "old"), calls[:2]):
            assert all(torch.equal(x, y) for x, y in zip(a, a_ref))
            assert torch.isfinite(o[ok]).all()
            worst[name] = max(worst[name], relative_error(o[ok].double(), o_ref[ok]))
    print(f"\n{shape} case {case}: worst relative error of the float32 scores against float64, "
          f"fused {worst['new']:.2e}, unfused {worst['old']:.2e}")
    for name in ("tokens", "parents", "depth", "num_nodes"):
        assert torch.equal(getattr(trees["new"], name), getattr(trees["old"], name)), name
    assert worst["new"] < 1e-5 and worst["old"] < 1e-5, worst
    assert worst["new"] > 0.0  # float32 rounding is there (else the comparison would prove nothing)

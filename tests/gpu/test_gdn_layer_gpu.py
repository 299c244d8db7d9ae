"""GPU test: the GDN layer's tree path after the per-layer host-work cut equals its previous version
(``tests/cpu/_gdn_before.py``) bit for bit with the real NVRTC kernels, at the Qwen3.6-27B GDN layer
shape per rank (H 16, HV 48, K = V 128, conv width 4, bf16 activations, float32 state), R = 1 and 8
requests with 33-node trees: outputs (written into ``core_attn_out`` by the verify kernel now) and
the stash the commit reads, with the verify pinned to version 3 (``VLLM_TFM_GDN_VERIFY=3``, the previous
code's); with the default (``auto``) the same within bf16 / float32 rounding. Two layers of one step alternate,
so the kept launch parameter arrays (``loader.param_array``) are re-pointed between launches of the same kernels.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_gdn_layer_gpu.py -q``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
import _gdn_before as before
from _gdn_layer import LayerCase, assert_same_layer_outcome, forward_context, random_trees, run_layer
from _trees import random_tree_parents

from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod
from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import kernels_in_use
from vllm_tfm.vllm_plugin.runtime.step_kernels import set_step_kernels

SHAPE = {"h": 16, "k": 128, "hv": 48, "v": 128, "width": 4}


@pytest.fixture(autouse=True)
def _kernels_only():
    from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason

    if not kernels_available():
        pytest.skip(f"NVRTC kernels unavailable: {kernels_unavailable_reason()}")
    assert set(kernels_in_use().values()) == {"kernels"}


@pytest.mark.parametrize("num_plain", [0, 5])
@pytest.mark.parametrize("num_req", [1, 8])
def test_gdn_layer_on_cuda_equals_the_previous_code(num_req, num_plain, monkeypatch):
    monkeypatch.setenv("VLLM_TFM_GDN_VERIFY", "3")  # the previous code's verify version, for bit equality
    trees = random_trees([33] * num_req, seed=num_req)
    layers = [LayerCase(trees, **SHAPE, num_plain=num_plain, device="cuda", seed=20 + i, bias=i == 1) for i in range(2)]
    layers[1].step = layers[0].step  # two layers of one step: the step's kernel tables are shared
    if num_plain:  # the plain rows' stand-in path of vLLM runs too; the spec rows are the tree path's
        layers[1].md.spec_token_indx = layers[0].md.spec_token_indx
        layers[1].md.non_spec_token_indx = layers[0].md.non_spec_token_indx
    results = {}
    with torch.inference_mode():
        for name, forward in (("before", before.tree_step_forward_core_before), ("after", gdn_mod._tree_step_forward_core)):
            for i, case in enumerate(layers):
                with forward_context(case):
                    results[name, i] = run_layer(forward, case)
                    results[name, i, "again"] = run_layer(forward, case)
    torch.cuda.synchronize()
    for i in range(2):
        assert_same_layer_outcome(results["after", i], results["before", i])
        assert_same_layer_outcome(results["after", i, "again"], results["before", i])
        assert results["after", i][0].abs().sum() > 0
    assert not torch.equal(results["after", 0][0], results["after", 1][0])  # two layers, two outcomes
    # the default (auto): version 6 where runtime_verify_variant picks it, the same function to bf16 / float32
    # rounding. One request: a grid of one wave of 128 CTAs, version 6. Eight requests: the batch holds a
    # chain and a deep tree of 33 nodes (depth 32 > PATH_SOLVE_MAX_DEPTH), so version 6 would take its level
    # solve on 1,024 CTAs, where it measured slower than version 3 (bench/NOTES.md sections 34 and 37): 3.
    monkeypatch.delenv("VLLM_TFM_GDN_VERIFY")
    set_step_kernels(None)  # the setting is read once per step: the same trees as a new step's tables
    kernels = gdn_mod.step_kernels(layers[0].step, torch.device("cuda"))
    if num_req > 1:  # the fourth tree is the chain
        assert torch.equal(trees[3].cpu(), torch.arange(-1, 32))
    expected = 6 if num_req == 1 else 3
    assert kernels.verify_variant(torch.bfloat16, SHAPE["h"], SHAPE["hv"], SHAPE["k"], SHAPE["v"]) == expected
    with torch.inference_mode():
        for i, case in enumerate(layers):
            with forward_context(case):
                out, stash = run_layer(gdn_mod._tree_step_forward_core, case)
            out0, stash0 = results["before", i]
            assert (out.float() - out0.float()).norm() <= 3e-3 * out0.float().norm()
            assert (stash.delta - stash0.delta).norm() <= 1e-5 * stash0.delta.norm()
            assert torch.equal(stash.k, stash0.k) and torch.equal(stash.g, stash0.g)


def test_gdn_layer_auto_runs_version_8_on_large_shallow_trees(monkeypatch):
    # per-step plans of eight 65-node trees whose paths have at most 17 nodes (random and star): ``auto`` runs
    # version 8 (its solve kernel, then the verify launched with programmatic dependent launch; bench/NOTES.md section
    # 76), and the layer's outcome is version 3's within bf16 / float32 rounding
    gen = torch.Generator().manual_seed(65)
    trees = [random_tree_parents(65, gen, "random" if i % 2 else "star") for i in range(8)]
    case = LayerCase(trees, **SHAPE, device="cuda", seed=66)
    results = {}
    for setting in ("3", "auto"):
        monkeypatch.setenv("VLLM_TFM_GDN_VERIFY", setting)
        set_step_kernels(None)  # the setting is read once per step
        kernels = gdn_mod.step_kernels(case.step, torch.device("cuda"))
        variant = kernels.verify_variant(torch.bfloat16, SHAPE["h"], SHAPE["hv"], SHAPE["k"], SHAPE["v"])
        assert variant == (3 if setting == "3" else 8), (setting, variant)
        assert kernels.plan.max_depth <= 16
        with torch.inference_mode(), forward_context(case):
            results[setting] = run_layer(gdn_mod._tree_step_forward_core, case)
    torch.cuda.synchronize()
    (out8, stash8), (out3, stash3) = results["auto"], results["3"]
    assert (out8.float() - out3.float()).norm() <= 3e-3 * out3.float().norm()
    assert (stash8.delta - stash3.delta).norm() <= 1e-5 * stash3.delta.norm()
    assert torch.equal(stash8.k, stash3.k) and torch.equal(stash8.g, stash3.g)

"""GPU tests of the tfm runtime in vLLM 0.26 (skipped without CUDA).

The unit checks run the runtime's device pieces against references (tree-masked Triton attention
vs torch, the GDN tree step on CUDA float32 vs CPU float64, DDTree on CUDA vs CPU). The end-to-end
test runs bench/gpu_plugin_e2e.py (two engine starts, a few minutes) and requires greedy tfm
output to equal the no-spec output token for token for the chain and DDTree cases.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]


def bench():
    spec = importlib.util.spec_from_file_location("gpu_plugin_e2e", REPO / "bench" / "gpu_plugin_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tree_attention_matches_torch():
    pytest.importorskip("vllm")
    res = bench().check_tree_attention("cuda")
    assert res["ok"], res


def test_gdn_tree_step_on_cuda_matches_float64_cpu():
    res = bench().check_gdn_step("cuda")
    assert res["ok"], res


def test_ddtree_on_cuda_equals_cpu():
    assert bench().check_ddtree_device("cuda")["ok"]


@pytest.mark.slow
def test_greedy_tfm_equals_no_spec(tmp_path):
    pytest.importorskip("vllm")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TFM_E2E_DIR=str(tmp_path / "models"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_plugin_e2e.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    results = json.loads((tmp_path / "results.json").read_text())
    assert "engine_error" not in results, results.get("engine_traceback")
    for case in results["cases"]:
        if case["proposal"] in ("chain", "ddtree") and "skipped" not in case:
            assert "error" not in case, case.get("traceback")
            assert case["equal"], (case["case"], case["batch"], case["divergences"], proc.stdout[-4000:])

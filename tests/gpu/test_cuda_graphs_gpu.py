"""tfm with CUDA graphs on the GPU (skipped without CUDA): bench/gpu_graphs_e2e.py on the toy zoo.

Every engine of that bench in parallel on the GPU (no-spec and tfm, eager, piecewise and full graphs, the
switches' controls, asynchronous scheduling, per-draft and one GDN state slot, tfm's default layout and the
one-slot fallback without full tree graphs), float32, 32 prompts x 64 greedy tokens at batch 8, batch 1 and
in waves. Every required verdict must hold (tfm equal to no-spec and to its controls token for token), and
every usage check (which graphs tree steps replayed, the GDN metadata paths, the device topology, the
deferred drafts, the one-slot commits, the waves). Several minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]


def test_greedy_tfm_with_cuda_graphs_equals_eager_and_no_spec(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_graphs_e2e.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    path = tmp_path / "graphs.json"
    assert path.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(path.read_text())
    for name, eng in res["engines"].items():
        assert eng["status"] == "ok", (name, eng.get("error"), (tmp_path / f"{name}.log").read_text()[-4000:])
    for key, v in res["verdicts"].items():
        if v["required"]:
            assert v["equal"], (key, {lb: v[lb].get("divergences") for lb in ("b8", "b1", "waves")})
    for name, g in res["graph_usage"].items():
        assert g["ok"], (name, g)
    for name, w in res["waves_usage"].items():  # the batch shrank and grew; full graphs returned to a size
        assert w["ok"], (name, w)
    assert res["engines"]["tfm-graphs"]["cudagraph_mode"] == "PIECEWISE"
    assert proc.returncode == 0, proc.stdout[-4000:]

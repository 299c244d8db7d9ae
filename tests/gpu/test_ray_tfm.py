"""tfm under Ray on one GPU (skipped without CUDA or without the Ray extra).

Runs bench/gpu_ray_e2e.py (three engine starts and a local Ray cluster: several minutes): greedy
tfm with ``distributed_executor_backend="ray"`` (TP=1) must give the default executor's tokens,
the worker must have run in a Ray actor with the plugin, the driver's tree options and trees
built, and the ``vllm_tfm.serve`` application must answer an OpenAI completion with the same
tokens and refuse a prompt_logprobs request with HTTP 400; all of it once with tfm's default
(synchronous) scheduling and once with ``async_scheduling=True``, each worker's config showing the
scheduling asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "asynchronous"])
def test_ray_executor_and_ray_serve_match_the_default_executor(tmp_path: Path, async_scheduling: bool) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("ray.serve.llm", reason="the Ray extra is not installed")
    env = dict(os.environ, TFM_RAY_DIR=str(tmp_path / "models"))
    cmd = [sys.executable, str(REPO / "bench" / "gpu_ray_e2e.py"), "--out", str(tmp_path)]
    proc = subprocess.run(
        cmd + (["--async-scheduling"] if async_scheduling else []),
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    path = tmp_path / "ray_results.json"
    assert path.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    verdicts = json.loads(path.read_text())["verdicts"]
    names = ("ray_equals_default", "ray_worker_in_actor", "serve_equals_default", "serve_refuses", "scheduling_as_asked")
    for name in names:
        assert verdicts[name] is True, (name, verdicts, proc.stdout[-4000:])

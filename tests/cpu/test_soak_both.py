"""bench/run_gpu_soak.sh's ``both`` mode and the per-GPU memory query it relies on.

``both`` runs the soak and the preempt phase at once, one GPU each; with a single GPU it must
refuse before installing anything unless asked for ``--sequential``. Each phase then reads the
memory of its own GPU only (nvidia-smi ignores CUDA_VISIBLE_DEVICES, so the query names it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from soak_server import visible_gpu_args


def test_visible_gpu_args() -> None:
    assert visible_gpu_args({"CUDA_VISIBLE_DEVICES": "1"}) == ["-i", "1"]
    assert visible_gpu_args({"CUDA_VISIBLE_DEVICES": "0,1"}) == ["-i", "0,1"]
    assert visible_gpu_args({"CUDA_VISIBLE_DEVICES": " "}) == []
    assert visible_gpu_args({}) == []


def _run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ, OUT=str(tmp_path / "out"), **env)
    return subprocess.run(["bash", str(ROOT / "bench" / "run_gpu_soak.sh"), *args], check=False, capture_output=True,
                          text=True, env=e, timeout=60, cwd=tmp_path)  # fmt: skip


def test_both_refuses_one_gpu_before_installing(tmp_path: Path) -> None:
    r = _run(["both"], tmp_path, CUDA_VISIBLE_DEVICES="0")
    assert r.returncode == 2
    assert "needs 2 GPUs" in r.stderr and "--sequential" in r.stderr
    assert "== bundle" not in r.stdout  # refused before the bundle is unpacked
    assert not (tmp_path / "out" / "pip.log").exists()


def test_unknown_phase_is_refused(tmp_path: Path) -> None:
    r = _run(["soakk"], tmp_path)
    assert r.returncode == 2 and "usage: bash bench/run_gpu_soak.sh soak|preempt|both" in r.stderr

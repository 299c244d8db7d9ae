"""bench/step_host.py: it times the runtime's own deferred ``StepTree.complete`` sequence, and the tables it
digests are those of the same step built from the real drafts without deferral."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.state import STATE
from vllm_tfm.vllm_plugin.runtime.step_kernels import set_step_kernels

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import step_host  # noqa: E402


@pytest.fixture(autouse=True)
def saved_state():
    saved = (STATE.store, STATE.metrics, STATE.step)
    STATE.metrics = Metrics(max_depth=16, device="cpu")
    yield
    STATE.store, STATE.metrics, STATE.step = saved
    set_step_kernels(None)


@pytest.mark.parametrize("num_reqs", [1, 3])
def test_the_deferred_step_holds_the_tables_of_the_real_drafts(num_reqs):
    case = step_host.Case(num_reqs, budget=16, max_depth=6, seed=num_reqs)
    digests = []
    for deferred in (True, False):
        step = case.step(deferred=deferred)
        step.complete()
        assert step.full_graph and not step.topology_pending
        digests.append(step_host.digest(step))
    assert digests[0] == digests[1]
    other = step_host.Case(num_reqs, budget=16, max_depth=6, seed=num_reqs + 10).step()
    other.complete()
    assert step_host.digest(other) != digests[0]  # the digest sees the trees


def test_the_bench_writes_its_rows_per_label(tmp_path):
    out = tmp_path / "host.json"
    for label in ("a", "b"):
        subprocess.run([sys.executable, str(REPO / "bench" / "step_host.py"), "--requests", "1", "2", "--budget", "8",
                        "--repeats", "3", "--label", label, "--out", str(out)], check=True, capture_output=True, text=True,
                       timeout=300)
    data = json.loads(out.read_text())
    assert sorted(data) == ["a", "b"]
    for label in ("a", "b"):
        rows = data[label]["results"]
        assert sorted(rows) == ["1", "2"] and data[label]["budget"] == 8
        for row in rows.values():
            assert 0 < row["complete"]["best_ms"] <= row["complete"]["p10_ms"] <= row["complete"]["median_ms"]
    assert data["a"]["results"]["1"]["digest"] == data["b"]["results"]["1"]["digest"]  # same seed, same tables

"""A full-graph step's topology on the device (runtime/device_topology.py), through the runtime's own
sequence on the CPU with the kernel emulated: a proposal put in the store, a step built from the
scheduler's placeholders with its topology pending, dispatched to a captured full tree graph, then
either the host path (``StepTree.complete`` before the forward) or the device path (the kernel, then
``complete`` at the first reader after the forward's launch). Both leave the same graph buffers,
positions (1-d, or M-RoPE's three rows), sequential positions, plan object and host arrays; the device
path is refused when a condition does not hold."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from _emulation import emulated, emulation_build_dir

from vllm_tfm.kernels.plan import TreePlan
from vllm_tfm.vllm_plugin.runtime import device_topology as dt
from vllm_tfm.vllm_plugin.runtime.full_graphs import TreeGraphs
from vllm_tfm.vllm_plugin.runtime.hooks import _tree_positions_and_counts
from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.state import PLACEHOLDER_DRAFT, STATE, ProposalStore
from vllm_tfm.vllm_plugin.runtime.step_kernels import current_step_kernels

B, R = 6, 3
N = B + 1


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_device_topology")


@pytest.fixture(autouse=True)
def _state(monkeypatch: pytest.MonkeyPatch) -> Any:
    # CPU tensors: the kernel runs through the emulation, so only its shape checks apply
    from vllm_tfm.kernels import step_topology as kst

    monkeypatch.setattr(kst, "unsupported_reason", kst._shape_error)
    saved = (STATE.store, STATE.metrics, STATE.step)
    STATE.store, STATE.metrics = ProposalStore(), Metrics(max_depth=B)
    dt.set_device_topology(None)
    yield
    STATE.store, STATE.metrics, STATE.step = saved
    dt.set_device_topology(None)


def _graphs() -> TreeGraphs:
    graphs = TreeGraphs(budget=B, max_reqs=R, max_seq_len=64, device=torch.device("cpu"))
    with graphs.capture(R):
        graphs.begin_run()
        STATE.step.gdn = {"layer.0": "stash"}
        graphs.end_capture_run(current_step_kernels(STATE.step))
    return graphs


def _proposal(rng: np.random.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    parents = np.array([[-1] + [int(rng.integers(0, k)) for k in range(1, N)] for _ in range(rows)], dtype=np.int64)
    tokens = torch.from_numpy(rng.integers(0, 1000, size=(rows, B))).to(torch.int64)
    return tokens, torch.from_numpy(parents)


def _step(graphs: TreeGraphs, req_ids: list[str], seed: int, order: list[str] | None = None,
          mrope: bool = False) -> tuple[Any, Any]:
    """Put a proposal (its rows in ``order``), build the next step of ``req_ids`` from placeholders and
    dispatch it to the full graph as graph_dispatch does; (step, runner)."""
    rng = np.random.default_rng(seed)
    order = order or req_ids
    tokens, parents = _proposal(rng, len(order))
    STATE.store.put(list(order), tokens, parents)
    spec = {rid: [PLACEHOLDER_DRAFT] * B for rid in req_ids}
    step = build_step_tree(req_ids, np.full(len(req_ids), N), spec, STATE.store, allow_trees=True,
                           device="cpu", defer_topology=True)
    tokens_max = len(req_ids) * N + 4  # vLLM's buffers are wider than the step
    sequential = torch.arange(tokens_max, dtype=torch.int64) + 100 * (seed + 1)
    runner = SimpleNamespace(uses_mrope=mrope, input_batch=SimpleNamespace(req_ids=list(req_ids)),
                             positions=sequential.clone(),
                             # M-RoPE rows that differ (after an image the three need not be equal)
                             mrope_positions=SimpleNamespace(gpu=torch.stack([sequential + 7 * q for q in range(3)])))
    step.after_topology(functools.partial(_tree_positions_and_counts, runner))
    step.replay_graphs = graphs
    step.after_topology(graphs.prepare_replay)
    STATE.step = step
    return step, runner


def _outcome(graphs: TreeGraphs, step: Any, runner: Any) -> dict[str, Any]:
    step.complete()  # the first reader after the forward's launch (host path: already done)
    kernels = current_step_kernels(step)
    return {"plan_buffer": graphs.plan_buffer.clone(), "attn_buffer": graphs.attn_buffer.clone(),
            "positions": (runner.mrope_positions.gpu if runner.uses_mrope else runner.positions).clone(),
            "seq_positions": step.seq_positions.clone(),
            "depth": step.depth.copy(), "spec_parents": step.spec_parents.copy(), "gdn": dict(step.gdn),
            "plan": kernels.plan, "full_graph": step.full_graph}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("plan_buffer", "attn_buffer", "positions", "seq_positions"):
        assert torch.equal(a[key], b[key]), key
    for key in ("depth", "spec_parents"):
        assert np.array_equal(a[key], b[key]), key
    assert a["gdn"] == b["gdn"] and a["full_graph"] and b["full_graph"]


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("order", [None, ["c", "a", "d", "b"]])  # the batch in the proposal's order, or not
def test_the_device_path_leaves_what_the_host_path_leaves(emu_dir: Path, order: list[str] | None,
                                                          mrope: bool) -> None:
    req_ids = ["a", "b", "c"]
    out = {}
    for mode in ("host", "device"):
        graphs = _graphs()
        first, runner = _step(graphs, req_ids, seed=1, order=order, mrope=mrope)  # the first replay of R writes the layout on the host
        assert not dt.launch_device_topology(runner, first) and first.topology_pending
        first.complete()
        dt.set_device_topology(mode == "device")
        step, runner = _step(graphs, req_ids, seed=2, order=order, mrope=mrope)
        builds = []
        real_build = TreePlan.build_into
        with emulated(emu_dir) as launches, mock.patch.object(
                TreePlan, "build_into", staticmethod(lambda *a, **k: builds.append(1) or real_build(*a, **k))):
            took = dt.launch_device_topology(runner, step)
            assert took == (mode == "device") and step.device_topology == took
            if took:  # the forward is launched now: the host's topology is still pending
                assert step.topology_pending and [name for name, *_ in launches] == ["tree_step_topology"]
            else:
                step.complete()
            out[mode] = _outcome(graphs, step, runner)
        assert out[mode]["plan"] is graphs.replay_layouts(R)[0]  # the layout's plan object, reused
        assert len(builds) == (0 if mode == "device" else 1)  # no host plan on the device path
    _same(out["host"], out["device"])
    assert STATE.metrics.hooks["topology.device"] == 1
    # the depth positions are root + depth, the sequential ones kept for the drafter
    d = out["host"]
    rows = d["positions"].view(-1, d["positions"].shape[-1])  # [1 or 3, tokens]
    seq = d["seq_positions"].view(rows.shape[0], -1)
    for q in range(rows.shape[0]):
        roots = seq[q, : R * N].view(R, N)[:, :1]
        assert torch.equal(rows[q, : R * N].view(R, N) - roots, torch.from_numpy(d["depth"]).view(R, N))
        tail = rows[q, R * N:]  # past the step: untouched, still counting on from the step's last position
        assert torch.equal(tail, seq[q, R * N - 1] + 1 + torch.arange(tail.numel()))


def test_the_device_path_is_refused_when_a_condition_does_not_hold(emu_dir: Path) -> None:
    req_ids = ["a", "b", "c"]
    graphs = _graphs()
    step, runner = _step(graphs, req_ids, seed=1)
    assert not dt.launch_device_topology(runner, step)  # no layout yet: the first replay of R
    step.complete()
    for setup in ("off", "not_full_graph", "absent", "done"):
        dt.set_device_topology(setup != "off")
        step, runner = _step(graphs, req_ids, seed=3, order=["a", "b"] if setup == "absent" else None)
        if setup == "not_full_graph":
            step.replay_graphs = None
        if setup == "done":
            step.complete()
        with emulated(emu_dir) as launches:
            assert not dt.launch_device_topology(runner, step), setup
            assert launches == [] and not step.device_topology
        step.complete()


def test_the_setting_reads_the_environment_unless_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dt.DEVICE_TOPOLOGY_ENV, "0")
    assert not dt.device_topology_enabled()
    dt.set_device_topology(True)
    assert dt.device_topology_enabled()
    dt.set_device_topology(None)
    monkeypatch.delenv(dt.DEVICE_TOPOLOGY_ENV)
    assert dt.device_topology_enabled()

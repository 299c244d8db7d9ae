"""A full-graph tree step's topology on the device: the host launches the forward without waiting
for the proposal's host copy (bench/NOTES.md section 41).

With deferred drafts (``deferred_drafts.py``) the scheduler holds placeholders and the step's tree
topology arrives with the proposal's host copy, at the drafter's end. Until now ``_preprocess``
then filled the topology on the host (``StepTree.complete``: the store's match, depths and bitmasks,
the step's upload, the depth positions, the full graph's two plans) and only then did vLLM launch
the forward. At batch 1 the host reaches that point after the drafter has ended (its work from
the sampled tokens' read-back to the forward's launch, ~6 ms on the H200 host, is longer than the
drafter's ~4 ms on the GPU), so those ~0.9 ms were spent with the GPU idle, every step.

A step that replays a full tree graph reads three things of its trees, all derived from the
proposal's parents, which are on the device already: the GDN plan, the tree attention's bitmasks
and the rows' depth positions. ``launch_device_topology`` writes them with one kernel
(``vllm_tfm.kernels.step_topology``, stream-ordered after the drafter) into the buffers the graph
reads, and marks the step (``StepTree.device_topology``). The host's topology is filled later, at
its first reader after the forward's launch (the sampler's tables), and ``prepare_replay`` and the
depth-position hook then skip what the kernel wrote. The Weaver build's deferred end
(``ProposalStore.finalize``, which may rewrite the trees in place) still runs first.

The device path is taken when every condition holds, else the host path runs as before:
``VLLM_TFM_DEVICE_TOPOLOGY`` is not 0; the step's topology is pending and it was dispatched to a
full tree graph whose R already replayed once (the buffers' layout exists); every request's
placeholders match the latest proposal in full; the kernel takes the shapes
(``step_topology.unsupported_reason``). With M-RoPE (the Qwen3.5 / 3.6 vision-language checkpoints'
class) the kernel writes root + depth into each of ``mrope_positions``' three rows, as the host path
does (a decode's text tokens advance the three together).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_tfm.kernels import step_topology as kst

from .settings import RuntimeSwitch
from .state import LOOKUP_FULL, STATE, StepTree

__all__ = ["DEVICE_TOPOLOGY_ENV", "device_topology_enabled", "launch_device_topology", "set_device_topology"]

DEVICE_TOPOLOGY_ENV = "VLLM_TFM_DEVICE_TOPOLOGY"
_SWITCH = RuntimeSwitch(DEVICE_TOPOLOGY_ENV, "set_device_topology")
_err: dict[torch.device, torch.Tensor] = {}


def device_topology_enabled() -> bool:
    """``VLLM_TFM_DEVICE_TOPOLOGY`` unset or not 0 / false (default on), unless ``set_device_topology``
    overrides it."""
    return _SWITCH.enabled()


def set_device_topology(enabled: bool | None) -> None:
    """Override the setting in this process (None: back to the environment's); for a same-engine A/B
    (bench/e2e.py --ab-switch device_topology, through ``collective_rpc``)."""
    _SWITCH.set(enabled)


def _row_map(rows: list[int], device: torch.device) -> torch.Tensor | None:
    """None when request r reads proposal row r (a batch in the proposal's order), else the rows."""
    if rows == list(range(len(rows))):
        return None
    host = torch.from_numpy(np.asarray(rows, dtype=np.int32))
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def launch_device_topology(runner: Any, step: StepTree) -> bool:
    """Write a full-graph step's plans and depth positions on the device (module docstring); True when
    it did, False when the host path must run (nothing written then)."""
    graphs = step.replay_graphs
    if graphs is None or not step.topology_pending or not device_topology_enabled():
        return False
    r, n = step.num_reqs, int(graphs.nodes)
    layouts = graphs.replay_layouts(r)
    if layouts is None or step.lookup is None or step.proposal_len is None:
        return False
    if not (bool((step.lookup == LOOKUP_FULL).all()) and bool((step.proposal_len == n - 1).all())):
        return False
    found = STATE.store.latest_parents(runner.input_batch.req_ids[:r], n)
    if found is None:
        return False
    parents, rows = found
    _, attn = layouts
    positions = runner.mrope_positions.gpu[:, : r * n] if runner.uses_mrope else runner.positions[: r * n]
    err = _err.get(parents.device)
    if err is None:
        err = _err[parents.device] = torch.zeros(1, dtype=torch.int32, device=parents.device)
    rows_dev = _row_map(rows, parents.device)
    if kst.unsupported_reason(parents, rows_dev, n, graphs.plan_buffer, attn.bits_dev, positions, err) is not None:
        return False
    step.seq_positions = positions.clone()  # sequential positions, for the drafter (as the host path keeps them)
    kst.step_topology_kernel(parents, rows_dev, n, graphs.plan_buffer, attn.bits_dev, positions, err)
    step.device_topology = True
    if STATE.metrics is not None:
        STATE.metrics.hook("topology.device")
    return True

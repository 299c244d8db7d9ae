#!/usr/bin/env python3
"""Host time of a tree step between the drafter's end and the target forward's launch (CPU).

With deferred drafts (runtime/deferred_drafts.py) the host waits in vLLM's ``_preprocess`` for the
proposal's host copy, then ``StepTree.complete`` fills the trees' topology, uploads the step's
tables, writes the depth positions and, on a full CUDA graph step, the graph's plans
(``TreeGraphs.prepare_replay``). Only then is the forward launched: the GPU is idle for all of it
(bench/NOTES.md sections 30 and 36: ~1.3 ms per batch-1 step on the H200's host). This bench runs
exactly that sequence on the CPU, with the runtime's code:

* a ``ProposalStore`` holding R proposals of B drafts (random trees of depth <= ``--max-depth``, the
  Weaver's bound), put as the proposer does (``put``; on the CPU there is no copy to wait for);
* ``build_step_tree`` with placeholder drafts and ``defer_topology=True`` (off the critical path:
  timed apart as ``build``), the depth positions and a ``TreeGraphs`` replay registered with
  ``after_topology`` as the runner's hooks do;
* ``complete`` (timed: ``complete``), then the sampler's first read of its tables (``sample_tables``,
  after the forward's launch in the runtime: timed apart).

Per R it prints and writes the median and best of ``--repeats`` runs, in ms, and a digest of every
table the step holds afterwards (equal across code versions that must produce the same tables).

Usage, from the repository root:

    python3 bench/step_host.py [--requests 1 8] [--budget 32] [--repeats 200] [--out bench/results/step_host_cpu.json]
        [--label NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_tfm.vllm_plugin.runtime import hooks  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.full_graphs import TreeGraphs  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.state import PLACEHOLDER_DRAFT, STATE, ProposalStore, StepTree  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.step_kernels import current_step_kernels, set_step_kernels  # noqa: E402


def bounded_tree(nodes: int, max_depth: int, rng: np.random.Generator) -> list[int]:
    """Parents of a random tree of ``nodes`` nodes, depth <= max_depth, parents before children: each node
    hangs below one of the last few nodes of depth < max_depth (a best-first tree's recent frontier)."""
    parents, depth = [-1], [0]
    for i in range(1, nodes):
        open_ = [j for j in range(max(0, i - 6), i) if depth[j] < max_depth] or [0]
        p = int(open_[int(rng.integers(0, len(open_)))])
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def make_runner(tokens: int) -> SimpleNamespace:
    return SimpleNamespace(positions=torch.arange(tokens, dtype=torch.int64), uses_mrope=False)


class Case:
    """R requests of B drafts: the proposals, a captured full tree graph of R requests, a runner."""

    def __init__(self, num_reqs: int, budget: int, max_depth: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.req_ids = [f"req-{r}" for r in range(num_reqs)]
        self.budget = budget
        self.tokens = torch.from_numpy(rng.integers(0, 248320, size=(num_reqs, budget)))
        self.parents = torch.tensor([bounded_tree(budget + 1, max_depth, rng) for _ in range(num_reqs)])
        self.graphs = TreeGraphs(budget, num_reqs, 4096, torch.device("cpu"), depth_bound=max_depth)
        with self.graphs.capture(num_reqs):
            self.graphs.begin_run()
            self.graphs.end_capture_run(current_step_kernels(STATE.step))
        self.runner = make_runner(num_reqs * (budget + 1))

    def step(self, deferred: bool = True) -> StepTree:
        """A fresh proposal and the next step's tree metadata with its topology pending (``deferred``: the
        runtime's deferred drafts; else the real drafts, everything done at once, for comparison)."""
        store = ProposalStore()
        store.put(self.req_ids, self.tokens, self.parents)
        STATE.store = store
        self.runner.positions.copy_(torch.arange(self.runner.positions.shape[0]))  # vLLM's sequential positions
        num_sched = np.full(len(self.req_ids), self.budget + 1, dtype=np.int64)
        if deferred:
            drafts = {rid: [PLACEHOLDER_DRAFT] * self.budget for rid in self.req_ids}
        else:
            drafts = {rid: self.tokens[i].tolist() for i, rid in enumerate(self.req_ids)}
        step = build_step_tree(self.req_ids, num_sched, drafts, store, allow_trees=True, defer_topology=deferred)
        if step.topology_pending != deferred:
            raise RuntimeError(f"the step's topology {'was not' if deferred else 'was'} deferred")
        step.after_topology(lambda s: hooks._tree_positions_and_counts(self.runner, s))
        step.after_topology(self.graphs.prepare_replay)
        return step


HOST_ARRAYS = ("query_start", "num_scheduled", "num_draft", "row_base", "req_index", "is_spec", "is_tree", "local_parent",
               "depth", "sample_parents", "sample_depth", "sample_cu", "spec_parents", "spec_cu", "spec_req_index",
               "lookup", "proposal_len")


def digest(step: StepTree) -> str:
    """Every host array and device table of the step after ``complete`` and the sampler's read."""
    h = hashlib.sha256()
    for name in HOST_ARRAYS:
        h.update(name.encode() + np.ascontiguousarray(getattr(step, name)).tobytes())
    for name in sorted(step._dev):
        h.update(name.encode() + step._dev[name].contiguous().numpy().tobytes())
    tables = step.sample_tables()
    for name in ("starts", "node_request", "global_parents", "children", "paths", "deepest"):
        h.update(name.encode() + getattr(tables, name).contiguous().numpy().tobytes())
    plan = current_step_kernels(step).plan
    for name in ("cu", "perm", "pos", "depth", "pair_off", "pair_j", "req_of"):
        h.update(name.encode() + getattr(plan, name).contiguous().numpy().tobytes())
    h.update(step.seq_positions.numpy().tobytes())
    return h.hexdigest()[:16]


def measure(case: Case, repeats: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"build": [], "complete": [], "sample_tables": []}
    last = None
    for i in range(repeats + 10):
        set_step_kernels(None)
        t0 = time.perf_counter()
        step = case.step()
        t1 = time.perf_counter()
        step.complete()
        t2 = time.perf_counter()
        step.sample_tables()
        t3 = time.perf_counter()
        if i >= 10:  # warm-up
            times["build"].append(t1 - t0)
            times["complete"].append(t2 - t1)
            times["sample_tables"].append(t3 - t2)
        last = step
    assert last is not None
    out: dict[str, Any] = {name: {"median_ms": statistics.median(v) * 1e3, "p10_ms": float(np.percentile(v, 10)) * 1e3,
                                  "best_ms": min(v) * 1e3} for name, v in times.items()}
    out["digest"] = digest(last)
    set_step_kernels(None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budget", type=int, default=32, help="B, drafts per request (n = B + 1 nodes)")
    ap.add_argument("--max-depth", type=int, default=15, help="the trees' depth bound (the 27B drafter's: 15)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (a vLLM worker's host work: 1)")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None, help="JSON file; entries are kept per --label")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    saved = (STATE.store, STATE.metrics, STATE.step)
    STATE.metrics = Metrics(max_depth=args.budget, device="cpu")
    results: dict[str, Any] = {}
    try:
        for r in args.requests:
            results[str(r)] = measure(Case(r, args.budget, args.max_depth, seed=r), args.repeats)
    finally:
        STATE.store, STATE.metrics, STATE.step = saved
    print(f"ms, median / 10th percentile / best of {args.repeats}")
    print(f"{'R':>3} {'build':>18} {'complete':>18} {'sample tables':>18}  digest")
    for r, row in results.items():
        cells = [f"{row[k]['median_ms']:.3f}/{row[k]['p10_ms']:.3f}/{row[k]['best_ms']:.3f}"
                 for k in ("build", "complete", "sample_tables")]
        print(f"{r:>3} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}  {row['digest']}")
    if args.out:
        path = Path(args.out)
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[args.label] = {"command": " ".join([sys.executable, *sys.argv]), "machine": platform.processor() or
                            platform.machine(), "budget": args.budget, "max_depth": args.max_depth,
                            "repeats": args.repeats, "results": results}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()

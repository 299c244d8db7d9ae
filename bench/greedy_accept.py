#!/usr/bin/env python3
"""Greedy tree acceptance of a tree step: the one-launch kernel (``cuda/tree_greedy_accept.cu``,
``vllm_tfm.kernels.greedy_accept``) against the torch path it replaces (the sampler's tree batch, the
``TreeTables`` upload, ``verify_greedy`` and vLLM's int32 layout), at the Qwen3.6-27B tree step's shapes on
the GPU host.

usage: python3 bench/greedy_accept.py [--out FILE] [--batches 1,8] [--budget 16] [--repeats 50]
       python3 bench/greedy_accept.py --sanitize-case   # small kernel-vs-reference run for compute-sanitizer

Per batch R: R requests of B + 1 = 17 nodes (random and deep trees), bf16 logits over 248,320 tokens with an
accepted path planted in each tree, int32 drafts. Both arms start from the logits and end with vLLM's
sampled_token_ids and the AcceptResult; the torch arm builds its tree batch and tables from the step's host
arrays as the sampler does (one host-to-device copy). Times, medians of ``--repeats`` after warm-up:

* ``*_eager_us``: CUDA-event time of 10 eager calls, per call (device time plus the gaps the host leaves: what a
  batch-1 step sees when the host issues these launches while the GPU waits);
* ``*_graph_us``: the same replayed from a CUDA graph (device time alone; the torch arm's host-to-device copy
  is made once outside the graph);
* ``*_host_us``: host time to issue one call;
* ``*_launches``: kernels and copies per call (torch profiler).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench", REPO / "tests" / "cpu"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _greedy_cases import GREEDY_CASES, greedy_batch, planted_step  # noqa: E402
from gdn_tree import host_us, kernel_bench_parser, result_header, time_calls, write_result  # noqa: E402

from vllm_tfm.kernels import greedy_accept as kga  # noqa: E402
from vllm_tfm.tree.bitmask import ragged_depths  # noqa: E402
from vllm_tfm.tree.types import TreeBatch  # noqa: E402
from vllm_tfm.verify.sampling import verify_greedy  # noqa: E402
from vllm_tfm.verify.tree_tables import TreeTables  # noqa: E402

VOCAB = 248320
CALLS = 10
DEV = torch.device("cuda")


def sanitize_case() -> None:
    """The shared test cases (both draft dtypes) against the reference (run under compute-sanitizer)."""
    for i, (sizes_kinds, follow) in enumerate(GREEDY_CASES):
        for dtype in (torch.int32, torch.int64):
            target, parents, cu, drafts, dmax, max_nodes, _ = greedy_batch(sizes_kinds, i, follow, dtype)
            args = (target.to(DEV), parents.to(DEV), cu.to(DEV), drafts.to(DEV), dmax, dmax + 2, max_nodes)
            reason = kga.unsupported_reason(*args)
            if reason is not None:
                raise SystemExit(f"sanitize case {i}: the kernel does not run: {reason}")
            got, sampled = kga.tree_greedy_accept(*args)
            ref, ref_sampled = kga.tree_greedy_accept_reference(*args)
            torch.cuda.synchronize()
            if not (torch.equal(sampled, ref_sampled) and torch.equal(got.accepted_nodes, ref.accepted_nodes)):
                raise SystemExit(f"sanitize case {i} ({dtype}): kernel and reference differ")
    print("sanitize case: the kernel gives the reference's result")


def problem(r: int, budget: int, seed: int) -> dict[str, Any]:
    n = budget + 1
    logits, parents, tokens = planted_step(r, n, VOCAB, seed)
    logits = logits.to(torch.bfloat16)
    cu = np.arange(r + 1, dtype=np.int64) * n
    par = parents.numpy()
    return {"logits": logits.to(DEV), "parents_host": par, "cu_host": cu, "depth_host": ragged_depths(par, cu),
            "parents": parents.to(DEV), "cu": torch.from_numpy(cu).to(DEV),
            "nonroot": torch.from_numpy(np.nonzero(par >= 0)[0]).to(DEV),
            "drafts": tokens[parents >= 0].to(torch.int32).to(DEV), "n": n}


def launches(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_case(r: int, budget: int, reps: int) -> dict[str, Any]:
    p = problem(r, budget, seed=r)
    logits, parents, cu, drafts, n = p["logits"], p["parents"], p["cu"], p["drafts"], p["n"]
    dmax = int(p["depth_host"].max())
    depth = torch.from_numpy(p["depth_host"]).to(DEV)
    tables = TreeTables.from_host(p["parents_host"], p["cu_host"], DEV, depth=p["depth_host"])

    def kernel() -> object:
        return kga.tree_greedy_accept_kernel(logits.argmax(dim=-1), parents, cu, drafts, dmax, n)

    def torch_path(tab: TreeTables | None = None) -> object:  # the sampler's torch path at temperature 0
        tokens = torch.zeros(parents.shape[0], dtype=torch.long, device=DEV)
        tokens.index_copy_(0, p["nonroot"], drafts.to(torch.long))
        t = tab if tab is not None else TreeTables.from_host(p["parents_host"], p["cu_host"], DEV, depth=p["depth_host"])
        res = verify_greedy(logits, TreeBatch(tokens, parents, depth, cu), t)
        out = torch.full((r, n), -1, dtype=torch.int32, device=DEV)
        out[:, : res.output_tokens.shape[1]] = res.output_tokens.to(torch.int32)
        return res, out

    got, sampled = kernel()
    want, want_sampled = torch_path()
    torch.cuda.synchronize()
    res: dict[str, Any] = {"batch": r, "nodes_per_tree": n, "dmax": dmax,
                           "equal": bool(torch.equal(sampled, want_sampled)
                                         and torch.equal(got.accepted_nodes, want.accepted_nodes)),
                           "accepted_drafts": got.num_accepted.tolist()}
    arms = {"kernel": (kernel, kernel), "torch": (torch_path, lambda: torch_path(tables))}
    for name, (eager, graphable) in arms.items():
        res[f"{name}_eager_us"], _ = time_calls([eager] * CALLS, reps, graph=False)
        res[f"{name}_graph_us"], res[f"{name}_graph_mode"] = time_calls([graphable] * CALLS, reps, graph=True)
        res[f"{name}_host_us"] = host_us(eager, reps)
        res[f"{name}_launches"] = launches(eager)
    res["argmax_graph_us"], _ = time_calls([lambda: logits.argmax(dim=-1)] * CALLS, reps, graph=True)
    return res


def main() -> int:
    ap = kernel_bench_parser(__doc__, repeats=50)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget", type=int, default=16)
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    reason = kga.unsupported_reason(*(torch.zeros(2, dtype=torch.int64, device=DEV),) * 3,
                                    torch.zeros(1, dtype=torch.int32, device=DEV), 1, 2, 2)
    if reason is not None:
        raise SystemExit(f"the kernel does not run here: {reason}")
    out = {**result_header("bench/greedy_accept.py"), "cases": []}
    print("| batch | nodes | equal | kernel eager / graph / host us | launches | torch eager / graph / host us | launches | argmax us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in (int(x) for x in args.batches.split(",")):
        c = bench_case(r, args.budget, args.repeats)
        out["cases"].append(c)
        print(f"| {r} | {c['nodes_per_tree']} | {c['equal']} | {c['kernel_eager_us']:.1f} / {c['kernel_graph_us']:.1f} / "
              f"{c['kernel_host_us']:.1f} | {c['kernel_launches']} | {c['torch_eager_us']:.1f} / {c['torch_graph_us']:.1f} / "
              f"{c['torch_host_us']:.1f} | {c['torch_launches']} | {c['argmax_graph_us']:.1f} |", flush=True)
    write_result(args.out, out)
    return 0 if all(c["equal"] for c in out["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The DFlash top-K of the Weaver build: the one-launch kernel (``cuda/topk_rows.cu``,
``vllm_tfm.kernels.topk_rows.topk_rows``) against the path it replaces (``torch.topk`` of a float32 copy of
the logits, what ``models.proposal_trees`` ran before) and against ``torch.topk`` of the 16-bit logits as
they are, at the Qwen3.6-27B shape on the GPU host.

usage: python3 bench/topk_rows.py [--out FILE] [--rows 15,120] [--k 512] [--vocab 248320] [--repeats 50]
       python3 bench/topk_rows.py --sanitize-case   # small kernel-vs-reference run for compute-sanitizer
       python3 bench/topk_rows.py --sweep           # the kernel alone at clusters 4, 8 and k 8, 64, 512

Rows: batch x depths (15 depths of a DFlash block of 16: 15 rows at batch 1, 120 at batch 8) of bf16 logits
(random normal, and a second set with only 64 distinct values, where the k-th value ties with thousands).
Times, medians of ``--repeats`` passes of 10 calls after warm-up: ``*_graph_us`` from a CUDA graph (device
time alone), ``*_eager_us`` eager (with the launch gaps the host leaves). Also whether the kernel's values
and indices equal ``topk_rows_reference`` (ties to the lower index), whether its values equal
``torch.topk``'s (the same multiset in the same order: ties differ only in their indices), and the time
one read of the logits takes at the measured copy bandwidth.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import (  # noqa: E402
    copy_bandwidth, kernel_bench_parser, past_budget, result_header, time_calls, write_result,
)

from vllm_tfm.kernels import topk_rows as ktk  # noqa: E402

CALLS = 10


def logits(rows: int, vocab: int, dtype: torch.dtype, ties: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if ties:
        return (torch.randint(0, 64, (rows, vocab), generator=g, device="cuda").float() / 8 - 4).to(dtype)
    return (torch.randn(rows, vocab, generator=g, device="cuda") * 3).to(dtype)


def check(x: torch.Tensor, k: int) -> dict[str, bool]:
    got_v, got_i = ktk.topk_rows(x, k)
    want_v, want_i = ktk.topk_rows_reference(x, k)
    tv = torch.topk(x.float(), k, dim=-1).values
    torch.cuda.synchronize()
    return {"equal_reference": bool(torch.equal(got_i, want_i) and torch.equal(got_v, want_v)),
            "values_equal_torch_topk": bool(torch.equal(got_v, tv))}


def sanitize_case() -> None:
    """Small calls at every cluster size and dtype, with ties, NaN and -inf (compute-sanitizer)."""
    for i, (dtype, c, v, k) in enumerate([(torch.bfloat16, 8, 5000, 512), (torch.float16, 4, 3001, 100),
                                          (torch.float32, 2, 2500, 64), (torch.bfloat16, 1, 700, 700)]):
        x = logits(3, v, dtype, ties=i % 2 == 1, seed=i)
        x[0, 7], x[1, : v // 2] = float("nan"), float("-inf")
        got_v, got_i = ktk.topk_rows(x, k, cluster=c)
        want_v, want_i = ktk.topk_rows_reference(x, k)
        torch.cuda.synchronize()
        if not (torch.equal(got_i, want_i) and torch.equal(got_v.nan_to_num(9.0), want_v.nan_to_num(9.0))):
            raise SystemExit(f"sanitize case {i} ({dtype}, cluster {c}, V {v}, k {k}): kernel and reference differ")
    print("sanitize case: the kernel selects the reference's entries")


def bench_case(rows: int, vocab: int, k: int, ties: bool, reps: int, bw: float) -> dict[str, Any]:
    x = logits(rows, vocab, torch.bfloat16, ties, seed=rows)
    reason = ktk.topk_rows_unsupported_reason(x, k)
    if reason is not None:
        raise SystemExit(f"the kernel does not run: {reason}")
    plan = ktk.launch_plan(rows, vocab, k, 2, torch.cuda.get_device_properties(0).multi_processor_count,
                           ktk.device_smem_optin(0))
    res: dict[str, Any] = {"rows": rows, "vocab": vocab, "k": k, "ties": ties, "cluster": plan[0],
                           "smem_bytes": plan[2], **check(x, k)}
    fns = {"kernel": lambda: ktk.topk_rows(x, k), "torch_float32": lambda: torch.topk(x.float(), k, dim=-1),
           "torch_bf16": lambda: torch.topk(x, k, dim=-1)}
    for name, fn in fns.items():
        res[f"{name}_graph_us"], res[f"{name}_graph_mode"] = time_calls([fn] * CALLS, reps, graph=True)
        res[f"{name}_eager_us"], _ = time_calls([fn] * CALLS, reps, graph=False)
    res["read_floor_us"] = rows * vocab * 2 / (bw / 2) * 1e6  # one read of the logits (bw counts read + write)
    return res


def sweep(rows_list: list[int], vocab: int, reps: int) -> None:
    """The kernel's graph time per call at clusters 4 and 8 and k = 8, 64, 512 (normal bf16 logits): how the
    time follows the entries per CTA (the cluster) and the sort (k)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in rows_list:
        x = (torch.randn(rows, vocab, generator=g, device="cuda") * 3).to(torch.bfloat16)
        for c in (4, 8):
            for k in (8, 64, 512):
                us, mode = time_calls([lambda: ktk.topk_rows(x, k, cluster=c)] * CALLS, reps, graph=True)
                print(f"rows {rows} cluster {c} k {k}: {us:7.1f} us ({mode})", flush=True)


def main() -> int:
    ap = kernel_bench_parser(__doc__, repeats=50)
    ap.add_argument("--sweep", action="store_true", help="the kernel alone at clusters 4, 8 and k 8, 64, 512")
    ap.add_argument("--rows", default="15,120")
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--budget-s", type=float, default=None, help="start no case past this many seconds")
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    if args.sweep:
        sweep([int(v) for v in args.rows.split(",")], args.vocab, 30)
        return 0
    bw = copy_bandwidth()
    res: dict[str, Any] = {**result_header("bench/topk_rows.py"), "copy_bandwidth_gb_s": bw / 1e9, "cases": [],
                           "skipped": []}
    start = time.perf_counter()
    for ties in (False, True):
        for rows in (int(v) for v in args.rows.split(",")):
            if past_budget(start, args.budget_s, res["skipped"], rows=rows, ties=ties):
                continue
            c = bench_case(rows, args.vocab, args.k, ties, args.repeats, bw)
            res["cases"].append(c)
            print(f"rows {rows:4d} ties {ties!s:5}: kernel {c['kernel_graph_us']:7.1f} us graph / "
                  f"{c['kernel_eager_us']:7.1f} eager (cluster {c['cluster']}); torch.topk float32 copy "
                  f"{c['torch_float32_graph_us']:7.1f} / {c['torch_float32_eager_us']:7.1f}; torch.topk bf16 "
                  f"{c['torch_bf16_graph_us']:7.1f}; read floor {c['read_floor_us']:5.1f}; reference "
                  f"{c['equal_reference']}, torch values {c['values_equal_torch_topk']}", flush=True)
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

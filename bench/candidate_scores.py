#!/usr/bin/env python3
"""The Weaver scorer's candidate scores: the kernel (``cuda/candidate_scores.cu``) against the torch
reference it replaces, at the Qwen3.6-27B drafter shape on the GPU host.

usage: python3 bench/candidate_scores.py [--out FILE] [--nodes 1x2,1x4,8x2,8x4,32x2] [--repeats 50]
       python3 bench/candidate_scores.py --sanitize-case   # small kernel-vs-float64 run for compute-sanitizer

Per R x w (requests x Weaver width) with H 5120, K 512, D 15, a bfloat16 lm_head of 248320 rows and
bfloat16 logits (the runtime's dtypes): CUDA-event medians of ``--repeats`` calls after warm-up of
``candidate_scores_reference`` (gather, float32 copy, batched GEMV) and of the kernel, each replayed
from a CUDA graph of 10 calls (device time: the runtime runs both inside its Weaver graphs), the bytes
the kernel must move (the R w K lm_head rows, the queries, ids, logits and scores) and the time
that takes at the measured device copy bandwidth (``bench/gdn_tree.py``'s ``copy_bandwidth``), and the max difference
between the two.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import (
    copy_bandwidth,
    kernel_bench_parser,
    result_header,
    time_calls,
    write_result,
)

from vllm_tfm.kernels import candidate_scores as kc
from vllm_tfm.models.vocab_table import candidate_scores_reference

H, VOCAB, DEPTH, TOP_K = 5120, 248320, 15, 512
CALLS_PER_GRAPH = 10  # calls per captured graph (bench/gdn_tree.py's time_calls: microseconds per call)


def sanitize_case() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for r, w, d, k, h, v, dt in ((1, 1, 1, 1, 8, 5, torch.float32), (2, 3, 5, 37, 264, 300, torch.bfloat16),
                                 (1, 2, 15, 64, 520, 1000, torch.float16)):
        table = torch.randn(v, h, generator=gen, device=dev).to(dt)
        ids = torch.randint(0, v, (r, d, k), generator=gen, device=dev)
        logits = torch.randn(r, d, k, generator=gen, device=dev)
        depths = torch.randint(0, d, (r, w), generator=gen, device=dev)
        q = torch.randn(r, w, h, generator=gen, device=dev).to(dt)
        got = kc.candidate_scores_kernel(table, ids, logits, depths, q)
        ref = candidate_scores_reference(table.double(), ids, logits.double(), depths, q.double())
        if float((got.double() - ref).abs().max()) > 1e-3:
            raise SystemExit(f"sanitize case {r}x{w}: kernel and float64 differ")
    torch.cuda.synchronize()
    print("sanitize case: the kernel equals the float64 scores to rounding")


def main() -> int:
    ap = kernel_bench_parser(__doc__, repeats=50)
    ap.add_argument("--nodes", default="1x2,1x4,8x2,8x4,32x2")
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    gen = torch.Generator(device=dev).manual_seed(0)
    head = (torch.randn(VOCAB, H, generator=gen, device=dev) * 0.05).to(torch.bfloat16)
    res: dict[str, Any] = {
        **result_header("bench/candidate_scores.py"),
        "shape": {"hidden": H, "vocab": VOCAB, "depth": DEPTH, "top_k": TOP_K, "dtype": "bfloat16"},
        "copy_bandwidth_gb_s": bw / 1e9,
        "cases": [],
    }
    for spec in args.nodes.split(","):
        r, w = (int(v) for v in spec.split("x"))
        ids = torch.randint(0, VOCAB, (r, DEPTH, TOP_K), generator=gen, device=dev)
        logits = (torch.randn(r, DEPTH, TOP_K, generator=gen, device=dev) * 3).to(torch.bfloat16)
        depths = torch.randint(0, DEPTH, (r, w), generator=gen, device=dev)
        q = torch.randn(r, w, H, generator=gen, device=dev).to(torch.bfloat16)
        call = (head, ids, logits, depths, q)
        ref_us, ref_mode = time_calls([lambda call=call: candidate_scores_reference(*call)] * CALLS_PER_GRAPH, args.repeats)
        ker_us, ker_mode = time_calls([lambda call=call: kc.candidate_scores_kernel(*call)] * CALLS_PER_GRAPH, args.repeats)
        got, ref = kc.candidate_scores_kernel(*call), candidate_scores_reference(*call)
        nodes = r * w
        moved = nodes * TOP_K * H * 2 + nodes * H * 2 + nodes * TOP_K * (8 + 2 + 4)
        case = {"requests": r, "width": w, "nodes": nodes, "reference_us": ref_us, "kernel_us": ker_us,
                "speedup": ref_us / ker_us, "timing": {"reference": ref_mode, "kernel": ker_mode}, "bytes": moved, "floor_us": moved / bw * 1e6,
                "kernel_of_floor": (moved / bw * 1e6) / ker_us,
                "max_abs_diff": float((got - ref.float()).abs().max())}
        res["cases"].append(case)
        print(f"R={r:2d} w={w}: reference {ref_us:7.1f} us, kernel {ker_us:6.1f} us ({case['speedup']:.1f}x), "
              f"floor {case['floor_us']:5.1f} us ({case['kernel_of_floor']:.0%} of it), max diff {case['max_abs_diff']:.2e}",
              flush=True)
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""The Weaver scorer's node attention: the one-launch kernel (``cuda/weaver_attention.cu``) against
the torch path it replaces (``node_attention_reference``: RoPE mul + addcmul, K/V scatter, the
key-mask rows' gather / scatter, SDPA with the additive mask, the output copy) at the Qwen3.6-27B
drafter's layer shape (8 heads of 128, D = 15, 33 node slots, bfloat16) on the GPU host.

usage: python3 bench/weaver_attention.py [--out FILE] [--cases 1:2,1:4,8:2,8:4,32:2] [--repeats 50]
       python3 bench/weaver_attention.py --sanitize-case    # small kernel-vs-float64 run for compute-sanitizer

Per case R:w (requests, nodes per request per call): device microseconds of one call of the first
layer (the mask rows written), replayed from a CUDA graph of 10 calls (``bench/gdn_tree.py``'s
``time_calls``), and the bytes the kernel must read (the span keys' K and V of every head, the
projection rows) with their time at the measured copy bandwidth.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench", REPO / "tests" / "cpu"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _attention_problem import check_results, problem, run_on_copies
from gdn_tree import (
    copy_bandwidth,
    kernel_bench_parser,
    result_header,
    time_calls,
    write_result,
)

from vllm_tfm.kernels import weaver_attention as ka

HEADS, HD, DEPTH, SLOTS = 8, 128, 15, 33


def sanitize_case() -> None:
    for seed, (r, w, heads, hd, depth, n, dt) in enumerate(((1, 1, 1, 4, 2, 2, torch.float32),
                                                           (3, 4, 2, 16, 5, 40, torch.bfloat16),
                                                           (2, 3, 3, 8, 4, 9, torch.float16))):
        args = problem(seed, r, w, heads, hd, depth, n, dt, device="cuda")
        # the kernel alone (torch's SDPA, which the reference runs, has races racecheck reports)
        check_results(args, True, run_on_copies(ka.node_attention_kernel, args, True), None)
    torch.cuda.synchronize()
    print("sanitize case: the kernel equals the float64 attention to rounding")


def main() -> int:
    ap = kernel_bench_parser(__doc__, repeats=50)
    ap.add_argument("--cases", default="1:2,1:4,8:2,8:4,32:2")
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    bw = copy_bandwidth()
    res: dict[str, Any] = {
        **result_header("bench/weaver_attention.py"),
        "dtype": "bfloat16", "shape": {"heads": HEADS, "head_dim": HD, "depth": DEPTH, "node_slots": SLOTS},
        "copy_bandwidth_gb_s": bw / 1e9, "cases": [],
    }
    for spec in args.cases.split(","):
        r, w = (int(v) for v in spec.split(":"))
        call = problem(r * 100 + w, r, w, HEADS, HD, DEPTH, SLOTS, torch.bfloat16, device="cuda")
        ref_us, ref_mode = time_calls([lambda call=call: ka.node_attention_reference(*call, True)] * 10, args.repeats)
        ker_us, ker_mode = time_calls([lambda call=call: ka.node_attention_kernel(*call, True)] * 10, args.repeats)
        span = 1 + DEPTH + SLOTS
        moved = 2 * r * HEADS * span * HD * 2 + call[0].numel() * 2
        case = {"requests": r, "width": w, "reference_us": ref_us, "kernel_us": ker_us, "speedup": ref_us / ker_us,
                "timing": {"reference": ref_mode, "kernel": ker_mode}, "bytes": moved, "floor_us": moved / bw * 1e6}
        res["cases"].append(case)
        print(f"R={r:2d} w={w}: reference {ref_us:6.1f} us, kernel {ker_us:6.1f} us ({case['speedup']:.2f}x), "
              f"bytes floor {case['floor_us']:5.2f} us", flush=True)
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

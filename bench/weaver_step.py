#!/usr/bin/env python3
"""One Weaver scorer call at the 27B drafter's Weaver shape: the one-launch step (``cuda/weaver_step.cu``,
``VLLM_TFM_WEAVER_STEP_KERNEL=1``) against the per-kernel path it replaces (17 launches: ``weaver_linear`` and
``weaver_attention``), both with the candidate scores and the log-softmax after them, on the GPU host.

usage: python3 bench/weaver_step.py [--out FILE] [--repeats 50] [--shapes 1x1,1x2,1x4,2x2]

Per (R requests x w nodes) and weights (e4m3 rows, the default arm's ``weaver_weights: "fp8"``, and bfloat16):
device microseconds of one call replayed from a CUDA graph (``bench/gdn_tree.py``'s ``time_calls``), the two
paths alternated twice; whether their log-probabilities are equal bit for bit; the weight bytes a call reads and
their time at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench", REPO / "tests" / "gpu"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _weaver27b import VOCAB, scorers_27b
from gdn_tree import copy_bandwidth, kernel_bench_parser, result_header, time_calls, write_result

from vllm_tfm.kernels import weaver_step as ks


def weight_bytes(folded, fp8: bool) -> int:
    """Bytes of the projections one call reads (e4m3 rows and their scales, or the 16-bit weights)."""
    return sum(w.numel() * w.element_size() + (0 if s is None else s.numel() * 4)
               for _, w, s, *_ in ks._linears(folded, fp8))


def main() -> None:
    ap = kernel_bench_parser(__doc__, 50)
    ap.add_argument("--shapes", default="1x1,1x2,1x4,2x2", help="R x w per call (R x w <= 4)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    res = {**result_header("bench/weaver_step.py"), "copy_bandwidth_gb_s": bw / 1e9, "cases": []}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for fp8 in (True, False):
        for r, w in shapes:
            base, twin = scorers_27b(r, (True, True), max_nodes=17, fp8=fp8)
            root = tuple(t.cuda() for t in (torch.zeros(r, 1, dtype=torch.long), torch.full((r, 1), -1),
                                            torch.randint(0, VOCAB, (r, 1)), torch.zeros(r, 1, dtype=torch.long),
                                            torch.ones(r, 1, dtype=torch.bool)))
            kids = tuple(t.cuda() for t in (torch.arange(1, w + 1).repeat(r, 1), torch.zeros(r, w, dtype=torch.long),
                                            torch.randint(0, VOCAB, (r, w)), torch.ones(r, w, dtype=torch.long),
                                            torch.ones(r, w, dtype=torch.bool)))

            def call(scorer, on: bool, inputs=kids):
                with mock.patch.dict(os.environ, {ks.ENV_SWITCH: "1" if on else "0"}):
                    return scorer(*inputs)

            grids: list[int] = []
            real_launch = ks.launch

            def recording_launch(kernel, grid, *a, **k):
                grids.append(int(grid[0]))
                return real_launch(kernel, grid, *a, **k)

            call(base, False, root)
            with mock.patch.object(ks, "launch", recording_launch):
                call(twin, True, root)
                call(twin, True)
            equal = torch.equal(call(base, False), call(twin, True))
            took = bool(twin._step_scratch.get(w) and twin._step_scratch[w][1] is None)
            us: dict[str, list[float]] = {"per_kernel": [], "one_launch": []}
            for _ in range(2):
                us["per_kernel"].append(time_calls([lambda: call(base, False)], args.repeats)[0])
                us["one_launch"].append(time_calls([lambda: call(twin, True)], args.repeats)[0])
            nbytes = weight_bytes(twin.folded, fp8 and r * w <= 4)
            case = {"r": r, "w": w, "fp8": fp8, "one_launch_taken": took, "grid_blocks": grids,
                    "reason": None if took else twin._step_scratch.get(w, (None, "not called"))[1],
                    "equal": equal, "us": us, "weight_bytes": nbytes, "floor_us": nbytes / bw * 1e6}
            res["cases"].append(case)
            print(f"fp8={fp8} R={r} w={w}: per-kernel {min(us['per_kernel']):.1f} us, one launch "
                  f"{min(us['one_launch']):.1f} us, floor {case['floor_us']:.1f} us, equal {equal}, taken {took}, grids {grids}",
                  flush=True)
            del base, twin
            torch.cuda.empty_cache()
    write_result(args.out, res)


if __name__ == "__main__":
    main()

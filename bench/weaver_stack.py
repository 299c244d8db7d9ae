#!/usr/bin/env python3
"""The Weaver scorer's block stack per growth round: one cooperative launch (``cuda/weaver_stack.cu``)
against the scorer's per-op path (``weaver_linear`` launches, cuBLAS above its row limit, and one
``weaver_node_attention`` per layer) at the Qwen3.6-27B drafter shape, on the GPU host.

usage: python3 bench/weaver_stack.py [--out FILE] [--rows 1,2,4,8,16] [--repeats 50] [--variants 0:6:0,0:6,1:3]
                                    [--timeline]
       python3 bench/weaver_stack.py --sanitize-case   # small stack-vs-per-op run for compute-sanitizer

``--variants B:S[:E],...``: the stack's forms timed side by side, B how stages are separated (the grid barrier,
``TFM_GRID_BARRIER`` 0 fences or 1 ordered atomics; 2: a counter per stage boundary, ``WS_SYNC=1``), S the chunk slots per warp (the ring's depth: S - 1 chunks in flight) and E
(default 1) ``WS_EARLY_EPILOGUE`` (1: a unit's bias and residual loads before its chunks; 0: after its sums,
section 52's form).

``--timeline``: each variant once more in its timing build (``WS_TIMELINE``: every block's global timer at
each stage's start and end), per stage: the blocks' work (start to end; median and max over blocks),
the wait before it (a block's start minus its own end of the stage before: the grid barrier and the
slowest block), the stage's span (first start to last end) and its weight bytes at the copy bandwidth.
The timing build has one more __syncthreads per stage, so its total is a little above the timed arm's.

Per row count M = R w (R requests of w nodes, w = 2 from M = 2 on): device microseconds of one
round's stack (token_in, three layers of qkv / attention / o_proj / gate_up / down, query; 8 heads of
128, d_rank 1024, d_mlp 3072, hidden 5120, bfloat16), each path replayed from a CUDA graph
(``bench/gdn_tree.py``'s ``time_calls``, arms alternated twice), the outputs' largest difference
(per-op at its production K split, so equal to rounding, not bit for bit), and the weight bytes
(121.6 MB) at the measured copy bandwidth (bytes touched per second, as bench/weaver_linear.py's
floor). A replay rewrites the same node rows of the K/V caches and key mask (same inputs), so
replays are idempotent.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import copy_bandwidth, kernel_bench_parser, result_header, time_calls, write_result

from vllm_tfm.kernels import weaver_attention as ka
from vllm_tfm.kernels import weaver_linear as kl
from vllm_tfm.kernels import weaver_stack as ks

HIDDEN, D, HEADS, HD, D_MLP, LAYERS, DEPTH, SLOTS = 5120, 1024, 8, 128, 3072, 3, 15, 33


def stack_problem(m: int, w: int, dtype=torch.bfloat16, seed: int = 0, hidden: int = HIDDEN, d: int = D,
                  heads: int = HEADS, hd: int = HD, d_mlp: int = D_MLP, layers: int = LAYERS) -> list[Any]:
    """The stack's arguments (``weaver_stack_reference``'s order): random weights scaled like trained
    ones, a random prompt part of every K/V cache, w nodes per request of depth 1 under the root."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    ahd = heads * hd
    lay = tuple(ks.StackLayer(rnd(6 * ahd, d, scale=d**-0.5), rnd(6 * ahd, scale=0.1), 1e-6, rnd(d, ahd, scale=ahd**-0.5),
                              rnd(2 * d_mlp, d, scale=d**-0.5), rnd(2 * d_mlp, scale=0.1), 1e-6,
                              rnd(d, d_mlp, scale=d_mlp**-0.5)) for _ in range(layers))
    weights = ks.StackWeights(rnd(d, hidden, scale=hidden**-0.5), rnd(d, scale=0.1), 1e-6, lay,
                              rnd(hidden, d, scale=d**-0.5), rnd(hidden, scale=0.1), 1e-6)
    r = m // w
    p0 = 1 + DEPTH
    kv = [rnd(2, r, heads, p0 + SLOTS + 1, hd) for _ in range(layers)]
    cols = -(-(p0 + SLOTS + 1) // 16) * 16
    key_bias = torch.full((r, SLOTS + 2, cols), float("-inf"), dtype=dtype, device="cuda")
    key_bias[:, :, :p0] = 0.0
    key_bias[:, 0, p0] = 0.0  # the root's row: the prompt and itself
    rope = rnd(DEPTH, 2, 3, 1, hd)
    node = (1 + torch.arange(w, device="cuda")).expand(r, w).contiguous()
    parent = torch.zeros(r, w, dtype=torch.long, device="cuda")
    depth = torch.ones(r, w, dtype=torch.long, device="cuda")
    valid = torch.ones(r, w, dtype=torch.bool, device="cuda")
    return [rnd(m, hidden), weights, rope, node, parent, depth, valid, kv, key_bias, p0, hd**-0.5]


def per_op(args: list[Any]) -> torch.Tensor:
    """The scorer's per-op path (``BatchedWeaverTreeScorer.__call__`` with its kernels), on ``args``."""
    return ks.per_op_stack(kl.weaver_linear, ka.node_attention, *args)


def stage_bytes(wts: ks.StackWeights) -> list[int]:
    """Weight bytes of each stage of ``ks.timeline_stages`` (0 for attention)."""
    nb = [wts.tok_w.numel()]
    for lw in wts.layers:
        nb += [lw.qkv_w.numel(), 0, lw.o_w.numel(), lw.gu_w.numel(), lw.down_w.numel()]
    return [n * wts.tok_w.element_size() for n in [*nb, wts.qry_w.numel()]]


def variant(spec: str) -> tuple[str, int, tuple[str, ...]]:
    """``B:S[:E]`` -> (arm name, chunk slots, -D options)."""
    parts = [int(v) for v in spec.split(":")]
    if len(parts) not in (2, 3):
        raise SystemExit(f"--variants takes B:S or B:S:E, not {spec!r}")
    barrier, slots, early = (*parts, 1)[:3]
    if barrier not in (0, 1, 2) or early not in (0, 1):
        raise SystemExit(f"--variants: B is 0, 1 or 2 and E is 0 or 1, not {spec!r}")
    name = f"stack_b{barrier}_s{slots}" + ("" if early == 1 else f"_e{early}")
    sync = (f"-DTFM_GRID_BARRIER={barrier}", "-DWS_SYNC=0") if barrier < 2 else ("-DWS_SYNC=1",)
    return name, slots, (*sync, f"-DWS_EARLY_EPILOGUE={early}")


def stage_timeline(prob: list[Any], defines: tuple[str, ...], slots: int, bw: float, runs: int = 5) -> dict[str, Any]:
    """One variant's stage-by-stage timeline (``--timeline``): the median over ``runs`` launches of each
    number (after one warm-up launch)."""
    names = ks.timeline_stages(len(prob[1].layers))
    ctas = ks.grid_size(0)
    per_run: list[dict[str, list[float]]] = []
    for i in range(runs + 1):
        marks = torch.zeros(ctas, len(names), 2, dtype=torch.int64, device=prob[0].device)
        ks.weaver_stack_kernel(*prob, slots=slots, defines=defines, marks=marks)
        if marks.is_cuda:
            torch.cuda.synchronize()
        if i == 0:
            continue
        t = (marks - marks[:, 0, 0].min()).double() / 1e3  # us from the first block's start
        work = t[:, :, 1] - t[:, :, 0]
        wait = torch.cat([torch.zeros(ctas, 1, dtype=t.dtype, device=t.device), t[:, 1:, 0] - t[:, :-1, 1]], 1)
        per_run.append({"work_median": work.median(0).values.tolist(), "work_max": work.max(0).values.tolist(),
                        "wait_median": wait.median(0).values.tolist(), "wait_max": wait.max(0).values.tolist(),
                        "span": (t[:, :, 1].max(0).values - t[:, :, 0].min(0).values).tolist(),
                        "total": [float(t[:, -1, 1].max())]})
    med = {k: [round(statistics.median(r[k][j] for r in per_run), 2) for j in range(len(per_run[0][k]))]
           for k in per_run[0]}
    floors = [round(1e6 * b / bw, 2) for b in stage_bytes(prob[1])]
    return {"stages": names, **{k: v for k, v in med.items() if k != "total"}, "total_us": med["total"][0],
            "floor_us": floors, "runs": runs}


def timeline_table(tl: dict[str, Any]) -> str:
    lines = [f"{'stage':>11} {'floor':>6} {'work med':>8} {'work max':>8} {'wait med':>8} {'wait max':>8} {'span':>7}"]
    for j, name in enumerate(tl["stages"]):
        lines.append(f"{name:>11} {tl['floor_us'][j]:6.2f} {tl['work_median'][j]:8.2f} {tl['work_max'][j]:8.2f} "
                     f"{tl['wait_median'][j]:8.2f} {tl['wait_max'][j]:8.2f} {tl['span'][j]:7.2f}")
    lines.append(f"{'total':>11} {sum(tl['floor_us']):6.2f} {sum(tl['work_median']):8.2f} {'':>8} "
                 f"{sum(tl['wait_median']):8.2f} {'':>8} {tl['total_us']:7.2f}")
    return "\n".join(lines)


def sanitize_case() -> None:
    """Small stacks (two dtypes, a long token_in row, 1 and 3 layers) through the kernel, bit for bit the
    per-op kernels with one warp per unit (``k_split`` 1) in the queries and the K/V caches."""
    split = kl.k_split
    kl.k_split = lambda units, k: 1
    try:
        for m, w, dt, hidden, layers in ((2, 2, torch.bfloat16, 1160, 1), (3, 1, torch.float32, 264, 3)):
            args = stack_problem(m, w, dt, seed=m, hidden=hidden, d=64, heads=2, hd=32, d_mlp=136, layers=layers)
            if ks.unsupported_reason(*args) is not None:
                raise SystemExit(f"sanitize case: {ks.unsupported_reason(*args)}")
            kv0 = [kv.clone() for kv in args[7]]
            got = ks.weaver_stack_kernel(*args)
            kv_got = [kv.clone() for kv in args[7]]
            for kv, k0 in zip(args[7], kv0):
                kv.copy_(k0)
            with torch.no_grad():
                orig = kl.KERNEL_ROWS
                kl.KERNEL_ROWS = ks.MAX_ROWS
                try:
                    want = per_op(args)
                finally:
                    kl.KERNEL_ROWS = orig
            if not (torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(kv_got, args[7]))):
                raise SystemExit(f"sanitize case M={m} {dt}: the stack and the per-op kernels differ")
    finally:
        kl.k_split = split
    torch.cuda.synchronize()
    print("sanitize case: the stack equals the per-op kernels bit for bit")


def main() -> None:
    ap = kernel_bench_parser(__doc__, 50)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--variants", default="0:6", help="stage sync (0, 1 grid barrier forms; 2 stage counters):chunk "
                                                      "slots[:early epilogue] of each stack arm")
    ap.add_argument("--timeline", action="store_true", help="each variant's stage-by-stage timeline too (WS_TIMELINE)")
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return
    bw = copy_bandwidth()
    res: dict[str, Any] = {**result_header("bench/weaver_stack.py"), "dtype": "bfloat16",
                           "copy_bandwidth_gb_s": bw / 1e9, "shape": {"hidden": HIDDEN, "d": D, "heads": HEADS, "hd": HD,
                                                                     "d_mlp": D_MLP, "layers": LAYERS, "depth": DEPTH,
                                                                     "slots": SLOTS}, "rows": []}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    for m in (int(v) for v in args.rows.split(",")):
        w = 1 if m == 1 else 2
        prob = stack_problem(m, w)
        reason = ks.unsupported_reason(*prob)
        if reason is not None:
            res["rows"].append({"rows": m, "skipped": reason})
            print(f"M={m}: skipped: {reason}")
            continue
        moved = sum(stage_bytes(prob[1]))
        floor_us = 1e6 * moved / bw  # the weights read once at the copy bandwidth (bench/weaver_linear.py's floor)
        fns = {"per_op": lambda prob=prob: per_op(prob)}
        for name, slots, defs in map(variant, args.variants.split(",")):
            fns[name] = lambda sl=slots, defs=defs, prob=prob: ks.weaver_stack_kernel(*prob, slots=sl, defines=defs)
        times: dict[str, list[float]] = {k: [] for k in fns}
        modes = {}
        with torch.no_grad():
            for name in list(fns) * 2:  # alternated
                us, mode = time_calls([fns[name]], args.repeats)
                times[name].append(round(us, 2))
                modes[name] = mode
            want = fns["per_op"]().float()
            diff = {k: float((f().float() - want).abs().max()) for k, f in fns.items() if k != "per_op"}
        row = {"rows": m, "w": w, "weight_bytes": moved, "floor_us": round(floor_us, 2), "us": times, "modes": modes,
               "max_abs_diff_vs_per_op": diff, "ctas": ks.grid_size(0)}
        res["rows"].append(row)
        print(f"M={m}: floor {floor_us:.1f} us; " + ", ".join(f"{k} {v}" for k, v in times.items())
              + f"; max |diff| {diff}; modes {set(modes.values())}")
        if args.timeline:
            row["timeline"] = {}
            for name, slots, defs in map(variant, args.variants.split(",")):
                with torch.no_grad():
                    tl = stage_timeline(prob, defs, slots, bw)
                row["timeline"][name] = tl
                print(f"M={m} {name} timeline (us; work and wait over blocks):")
                print(timeline_table(tl))
    write_result(args.out, res)


if __name__ == "__main__":
    main()

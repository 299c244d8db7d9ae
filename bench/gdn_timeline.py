#!/usr/bin/env python3
"""Verify versions 6, 7 and 8 (cuda/gdn_tree_verify_grouped.cu, _small.cu, _paths.cu) from inside: per-CTA phase times.

Thread 0 of every CTA writes the global timer and the SM clock at the kernel's start and after each
phase's barrier (``timeline6`` / ``timeline7`` / ``timeline8`` of ``vllm_tfm.kernels.gdn.verify_launches``). This prints, per (n,
batch), the median and the largest time of each phase over the CTAs, the span from the first CTA's
start to the last one's end, and the graph-timed whole call (bench/gdn_tree.py's timing) beside it:
what the CTAs do against what the launch costs. Versions 7 and 8 record their marks in a replayed CUDA
graph, as the call is timed; for version 8 the solve kernel's CTAs mark their start and end too, and a
second table sets them against the verify CTAs (how many verify CTAs started before the solve ended; the
verify kernel waits for it after its projections, within its "projections" phase).
Same trees and inputs as bench/gdn_tree.py.

usage (GPU host, repository root):  python3 bench/gdn_timeline.py [--out FILE] [--n 32 128] [--batch 1 8]
                                    python3 bench/gdn_timeline.py --variant 7 --n 17 32 --batch 1 8 32 --block-v 16 32
                                    python3 bench/gdn_timeline.py --variant 8 --n 33 65 128 --batch 1 8 --block-v 32 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_phases import phase_case  # noqa: E402
from gdn_tree import VD, machine_info, time_calls  # noqa: E402

from vllm_tfm.kernels import gdn as kgdn  # noqa: E402
from vllm_tfm.kernels import loader  # noqa: E402

# with the path solve (G6_SOLVE=1) "projections" also holds phase 2b (the path rows of T and W) and
# "substitution" is the gathers of the outputs; with the level solve (G6_SOLVE=0) it is the substitution
SOLVES = {"levels": 0, "paths": 1}
PHASES = ("loads_tables", "norms_gram", "coefficients_split", "projections", "substitution")
PHASES7 = ("copies", "masks_gates", "norms_grams_projections", "coefficients", "solve_outputs")
PHASES8 = ("copies_tables", "norms_entries", "grams_warp0", "grams_s0_wait", "xy_scales", "projections", "r_and_path_rows",
           "outputs")
PHASES8_SOLVE = ("tables_paths", "entries_qk", "norms_grams", "scales", "path_rows")  # its solve kernel
# the one-kernel versions with their own timeline: marks, phase names, V-width option, kernel, CTAs per q/k
# head (7: one per q/k head; 8: one per value head) and verify_launches' timeline keyword
ONE_KERNEL = {
    7: dict(marks=kgdn.SMALL_MARKS, phases=PHASES7, bv_option="-DS7_BV", kernel="gdn_tree_verify_small",
            per_qk_head=lambda group: 1, keyword="timeline7"),
    8: dict(marks=kgdn.PATHS_MARKS, phases=PHASES8, bv_option="-DP8_BV", kernel="gdn_tree_verify_paths",
            per_qk_head=lambda group: group, keyword="timeline8"),
}


def timeline_one(variant: int, n: int, batch: int, reps: int, block_v: int, defines: tuple[str, ...] = ()) -> dict:
    """Version 7's or 8's per-CTA phases at ``block_v`` V columns a CTA (their timeline marks)."""
    spec = ONE_KERNEL[variant]
    opts = (f"{spec['bv_option']}={block_v}", *[f"-D{d}" for d in defines])
    plan, sets, inputs, pool, slots = phase_case(n, batch)
    fns = []
    for s in range(sets):
        x = inputs[s]
        launches, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[s],
                                              return_delta=True, variant=variant, extra_options=opts)
        if launches[-1][0] != spec["kernel"]:  # version 8: its solve kernel first (P8_PREGRAM=1)
            return dict(n=n, batch=batch, variant=variant, error=f"version {variant} does not take n={n}")
        fns.append(lambda ls=launches: [fn() for _, fn in ls])
    call_us, _ = time_calls(fns, reps)
    x = inputs[0]
    h, hv = x["q"].shape[1], x["v"].shape[1]
    ctas = plan.num_requests * h * spec["per_qk_head"](hv // h) * (VD // block_v)
    buf = torch.zeros(ctas, spec["marks"], 2, dtype=torch.int64, device="cuda")
    extra = {spec["keyword"]: buf}
    solve_buf = None
    if len(launches) == 2:  # version 8's solve kernel: its CTAs' start and warp 0's end
        grid_g = launches[0][1].config[0]
        solve_buf = torch.zeros(grid_g[0] * grid_g[1] * grid_g[2], kgdn.PATHS_SOLVE_MARKS, 2, dtype=torch.int64,
                                device="cuda")
        extra["timeline8_solve"] = solve_buf
    launches, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                          return_delta=True, variant=variant, extra_options=opts, **extra)
    # the last of three back-to-back calls (warm caches of the tables) in a replayed CUDA graph, as the call is
    # timed: no launch gaps, so version 8's verify kernel can start while its solve kernel runs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            for _, fn in launches:
                fn()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    row = dict(n=n, batch=batch, variant=variant, block_v=block_v, defines=list(defines), nodes=plan.num_nodes,
               max_depth=plan.max_depth, ctas=ctas, call_us=call_us)
    row.update(cta_times(buf.cpu(), spec["phases"]))
    if solve_buf is not None:
        row["solve"] = solve_overlap(solve_buf.cpu(), buf.cpu())
        row["solve"].update(cta_times(solve_buf.cpu(), PHASES8_SOLVE))
    return row


def solve_overlap(grams: torch.Tensor, verify: torch.Tensor) -> dict:
    """Version 8's solve kernel against its verify kernel, from their [CTAs, marks, (global ns, SM clock)]: us from
    the first solve CTA's start to the last solve CTA's end, to the first verify CTA's start and to the last verify
    CTA's end, and how many verify CTAs started before the last solve CTA ended (programmatic dependent launch at
    work: 0 when the verify CTAs wait for SMs the solve CTAs hold)."""
    g0, g_end = grams[:, 0, 0].min(), grams[:, -1, 0].max()
    v_start, v_end = verify[:, 0, 0], verify[:, -1, 0]
    return dict(ctas=int(grams.shape[0]), solve_end_us=float(g_end - g0) / 1e3, verify_start_us=float(v_start.min() - g0) / 1e3,
                verify_end_us=float(v_end.max() - g0) / 1e3, verify_ctas_early=int((v_start < g_end).sum()))


def cta_times(marks: torch.Tensor, phases: tuple[str, ...]) -> dict:
    """From [CTAs, marks, (global ns, SM clock)]: the SM clock's rate, the span from the first CTA's start to the
    last one's end, the median CTA, the start spread and each phase's median and largest time over the CTAs (us)."""
    ns, clk = marks[:, :, 0].double(), marks[:, :, 1].double()
    last = len(phases)
    ghz = statistics.median(((clk[:, last] - clk[:, 0]) / (ns[:, last] - ns[:, 0]).clamp(min=1)).tolist())
    out = dict(clock_ghz=ghz, span_us=float(ns[:, last].max() - ns[:, 0].min()) / 1e3,
               cta_us_median=statistics.median(((clk[:, last] - clk[:, 0]) / ghz / 1e3).tolist()),
               start_spread_us=float(ns[:, 0].max() - ns[:, 0].min()) / 1e3, phase_us={})
    for k, name in enumerate(phases):
        d = ((clk[:, k + 1] - clk[:, k]) / ghz / 1e3).tolist()
        out["phase_us"][name] = {"median": statistics.median(d), "max": max(d)}
    return out


def table_one(variant: int, rows: list[dict]) -> str:
    phases = ONE_KERNEL[variant]["phases"]
    lines = [f"GDN tree verify version {variant} from inside (us; per-CTA SM clock, median / max over CTAs; span = "
             "first start to last end; call = graph-timed whole call)",
             f"{'n':>4} {'batch':>5} {'BV':>3} {'ctas':>5} {'call':>7} {'span':>7} {'cta':>7} {'spread':>7} | "
             + " ".join(f"{p[:13]:>13}" for p in phases)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['n']:>4} {r['batch']:>5} {r['error']}")
            continue
        ph = r["phase_us"]
        lines.append(f"{r['n']:>4} {r['batch']:>5} {r['block_v']:>3} {r['ctas']:>5} {r['call_us']:>7.1f} {r['span_us']:>7.1f} "
                     f"{r['cta_us_median']:>7.1f} {r['start_spread_us']:>7.1f} | "
                     + " ".join(f"{ph[p]['median']:>6.2f}/{ph[p]['max']:<6.2f}" for p in phases)
                     + (f"  {' '.join(r['defines'])}" if r.get("defines") else ""))
    solved = [r for r in rows if "solve" in r]
    if solved:
        lines.append("version 8's solve kernel, us from its first CTA's start: its last CTA's end, the first verify CTA's "
                     "start, the last verify CTA's end; verify CTAs started before the solve ended")
        lines.append(f"{'n':>4} {'batch':>5} {'ctas':>5} {'solve':>7} {'v start':>7} {'v end':>7} {'early':>5} | "
                     "solve CTA phases, median / max: " + " ".join(f"{p:>13}" for p in PHASES8_SOLVE))
        for r in solved:
            g = r["solve"]
            lines.append(f"{r['n']:>4} {r['batch']:>5} {g['ctas']:>5} {g['solve_end_us']:>7.1f} {g['verify_start_us']:>7.1f} "
                         f"{g['verify_end_us']:>7.1f} {g['verify_ctas_early']:>5} | "
                         + " ".join(f"{g['phase_us'][p]['median']:>6.2f}/{g['phase_us'][p]['max']:<6.2f}" for p in PHASES8_SOLVE)
                         + (f"  {' '.join(r['defines'])}" if r.get("defines") else ""))
    return "\n".join(lines)


def timeline(n: int, batch: int, reps: int, threads: int | None, parts: int = 3, solve: str = "auto",
             defines: tuple[str, ...] = (), cluster: int = 0) -> dict:
    opts = ([f"-DGDN_S0_PARTS={parts}"] + ([f"-DG6_SOLVE={SOLVES[solve]}"] if solve != "auto" else [])
            + ([f"-DG6_CLUSTER={cluster}"] if cluster else []) + [f"-D{d}" for d in defines])
    plan, sets, inputs, pool, slots = phase_case(n, batch)
    fns = []
    for s in range(sets):
        x = inputs[s]
        launches, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[s],
                                              return_delta=True, variant=6, threads6=threads, extra_options=opts)
        if [name for name, _ in launches] != ["gdn_tree_verify_grouped"]:
            return dict(n=n, batch=batch, error=f"version 6 does not take n={n}")
        fns.append(launches[0][1])
    call_us, _ = time_calls(fns, reps)
    x = inputs[0]
    h = x["q"].shape[1]
    chosen = kgdn.grouped_solve(plan, x["q"].shape[2], x["v"].shape[1] // h, kgdn.device_smem_optin(0), opts)
    n_threads = threads or kgdn.grouped_threads(
        plan, h, VD, kgdn.grouped_smem_bytes(x["q"].shape[2], x["v"].shape[1] // h, plan.max_nodes,
                                             plan.max_pairs_per_request, solve_levels=chosen == 0),
        kgdn.SM_SMEM_BYTES, torch.cuda.get_device_properties(0).multi_processor_count)
    cl = kgdn.grouped_cluster(plan, VD, n_threads, torch.cuda.get_device_properties(0).major, opts)
    run = launches[0][1]
    # clusters the device holds at once (one wave): cuOccupancyMaxActiveClusters
    max_clusters = loader.max_active_clusters(run.kernel, *run.config) if cl > 1 else None
    ctas = plan.num_requests * h * (VD // kgdn.GROUPED_BV)
    buf = torch.zeros(ctas, kgdn.GROUPED_MARKS, 2, dtype=torch.int64, device="cuda")
    launches, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                          return_delta=True, variant=6, threads6=threads, timeline6=buf,
                                          extra_options=opts)
    for _ in range(3):  # the last of three back-to-back calls (warm caches of the tables, as in a graph)
        launches[0][1]()
    torch.cuda.synchronize()
    # these options' outputs against the default kernel's: equal bit for bit, or (another solve or S0
    # split) the relative difference of delta
    ls, o_l, d_l = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                        return_delta=True, variant=6, threads6=threads, extra_options=opts)
    ls[0][1]()
    o_k, d_k = kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                            return_delta=True, variant=6)
    equals_kernel = bool(torch.equal(o_l, o_k) and torch.equal(d_l, d_k))
    delta_rel_vs_kernel = float((d_l.double() - d_k.double()).norm() / d_k.double().norm())
    row = dict(n=n, batch=batch, nodes=plan.num_nodes, pairs=plan.num_pairs, max_depth=plan.max_depth, ctas=ctas,
               threads=threads or "auto", s0_parts=parts, defines=list(defines),
               cluster=cl if cluster else f"auto-{cl}", max_active_clusters=max_clusters,
               solve=solve if solve != "auto" else f"auto-{'paths' if chosen else 'levels'}",
               equals_kernel=equals_kernel, delta_rel_vs_kernel=delta_rel_vs_kernel, call_us=call_us)
    row.update(cta_times(buf.cpu(), PHASES))
    return row


def table(rows: list[dict]) -> str:
    lines = ["GDN tree verify version 6 from inside (us; per-CTA SM clock, median / max over CTAs; span = first start to "
             "last end; call = graph-timed whole call; cl:max = CTAs per cluster : clusters the device holds at once)",
             f"{'n':>4} {'batch':>5} {'thr':>4} {'S0':>2} {'solve':>12} {'cl:max':>9} {'eq':>2} {'drel':>7} {'call':>7} {'span':>7} {'cta':>7} {'spread':>7} | "
             + " ".join(f"{p[:12]:>13}" for p in PHASES)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['n']:>4} {r['batch']:>5} {r['error']}")
            continue
        ph = r["phase_us"]
        mac = r.get("max_active_clusters")
        cl = f"{r.get('cluster', 1)}" + (f":{mac}" if mac else "")
        lines.append(f"{r['n']:>4} {r['batch']:>5} {str(r['threads']):>4} {r['s0_parts']:>2} {r['solve']:>12} {cl:>9} "
                     f"{int(r['equals_kernel']):>2} {r['delta_rel_vs_kernel']:>7.1e} {r['call_us']:>7.1f} {r['span_us']:>7.1f} "
                     f"{r['cta_us_median']:>7.1f} {r['start_spread_us']:>7.1f} | "
                     + " ".join(f"{ph[p]['median']:>6.2f}/{ph[p]['max']:<6.2f}" for p in PHASES))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gdn_timeline_v6.json"))
    ap.add_argument("--n", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[0], help="CTA sizes (0: the automatic choice)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--s0-parts", type=int, nargs="+", default=[3], help="S0 split parts (3: the kernel; 2: timing only)")
    ap.add_argument("--solve", nargs="+", choices=("auto", *SOLVES), default=["auto"],
                    help="phase 4's solve: auto (the wrapper's choice, grouped_solve), levels (G6_SOLVE=0), paths (1)")
    ap.add_argument("--cluster", type=int, nargs="+", default=[0],
                    help="CTAs per thread block cluster, G6_CLUSTER (0: the wrapper's choice, grouped_cluster)")
    ap.add_argument("--variant", type=int, choices=(6, 7, 8), default=6, help="the verify version to look into")
    ap.add_argument("--block-v", type=int, nargs="+", default=[0],
                    help="versions 7 and 8: V columns per CTA (S7_BV / P8_BV; 0: the wrapper's choice)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a timing-only compile constant for every row (e.g. G6_DPAD=0, GDN_PROFILE_SKIP=16); repeatable")
    args = ap.parse_args()
    bad = [d for d in args.define if not d.split("=", 1)[0].isidentifier() or d.startswith(("G6_SOLVE", "GDN_S0_PARTS", "G6_CLUSTER"))]
    if bad:
        sys.exit(f"--define takes NAME=VALUE for a compile constant other than G6_SOLVE / GDN_S0_PARTS / G6_CLUSTER "
                 f"(use --solve / --s0-parts / --cluster): {bad}")
    if not torch.cuda.is_available() or not loader.kernels_available():
        sys.exit(f"gdn_timeline.py needs a CUDA device and the NVRTC kernels: {loader.kernels_unavailable_reason()}")
    start = time.perf_counter()
    if args.variant in ONE_KERNEL:
        auto = kgdn.small_block_v(VD) if args.variant == 7 else kgdn.paths_block_v(VD)
        rows = [timeline_one(args.variant, n, b, args.reps, bv or auto, tuple(args.define)) for b in args.batch
                for n in args.n for bv in args.block_v]
        text = table_one(args.variant, rows)
    else:
        rows = [timeline(n, b, args.reps, t or None, parts, sw, tuple(args.define), cl) for b in args.batch
                for n in args.n for t in args.threads for parts in args.s0_parts for sw in args.solve for cl in args.cluster]
        text = table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command=" ".join([sys.executable, *sys.argv]), machine=machine_info(), rows=rows,
                                   elapsed_s=time.perf_counter() - start), indent=1))
    Path(str(out).replace(".json", ".txt")).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
